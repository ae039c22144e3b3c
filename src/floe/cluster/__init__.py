"""floe on Ray: replicas of `floe serve`'s engine core behind one OpenAI endpoint, with session
affinity, migration, drain and failover through the shared session store (docs/RAY.md)."""
