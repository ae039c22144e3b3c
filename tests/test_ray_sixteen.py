"""The issue's size for floe on Ray (tests/test_ray.py's cluster, in a module of its own: one Ray per
process): 16 named sessions × 3 turns over three replicas, a node lost after turn 2 (~40 s on 2 cores)."""

import pytest

pytest.importorskip("ray")
from test_ray import killed_mid_conversation, ray_front  # noqa: E402
from test_server import client, conversation  # noqa: E402


def test_sixteen_sessions_three_turns_survive_a_node_loss(tmp_path):
    with ray_front(tmp_path / "shared") as front:
        reference = conversation(client(front.url), "reference")[0]
        killed_mid_conversation(front, reference, [f"n{i:02d}" for i in range(16)])
