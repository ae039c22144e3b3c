"""`floe serve`: the OpenAI-compatible server whose sessions are actors (see floe.server.app)."""
