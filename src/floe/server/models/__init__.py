"""Several models in one `floe serve` (docs/SERVER.md, "Several models"): each model its own engine core
(floe.server.core.ServeCore: engine, engine loop, session store) made when a request first names it
and closed after its idle time or to make room; a request's `model` picks the core.

`ModelRouter` answers the engine core's socket (floe.server.core_socket) as one ServeCore does. Each
model keeps its sessions' snapshot store while it is not loaded (its sessions frozen there), so a
session is bound to its model: naming it on another model is a 409, never a silent mix.

The parts, each with one job: specs (the models' names, checked), served (one model: its core, its
store, its counts), residency (which models are loaded: load on demand, unload idle or for room),
metrics (/metrics per model) and router (the core's surface: a request to its model's core).
"""

from floe.server.models.router import ModelRouter
from floe.server.models.served import ModelLoadFailed, ServedModel
from floe.server.models.specs import ModelSpec, keep_alive_seconds, model_specs, models_in

__all__ = ["ModelLoadFailed", "ModelRouter", "ModelSpec", "ServedModel", "keep_alive_seconds", "model_specs",
           "models_in"]
