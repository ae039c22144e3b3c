import os
import sys
from pathlib import Path

import pytest

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def default_checkpoint():
    from floe.model import load_checkpoint

    return load_checkpoint()


@pytest.fixture(scope="session")
def default_engine(default_checkpoint):
    from floe.engine import Engine

    return Engine(default_checkpoint, max_seq_len=2048)


@pytest.fixture(scope="session")
def reference_model():
    """transformers loading the same GGUF, on CPU in fp32: the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from floe.model import default_model_path

    p = default_model_path()
    return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def reference_tokenizer():
    from transformers import AutoTokenizer

    from floe.model import default_model_path

    p = default_model_path()
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


@pytest.fixture(scope="session")
def tiny_engine():
    """A 2-layer model of random weights with the default model's real tokenizer: the engine for
    tests about the sandbox, where what matters is the host, not the model's answers."""
    from models import tiny_engine as make

    return make()


@pytest.fixture(scope="session")
def chat_v1(tmp_path_factory):
    """floe's chat guest built for ABI v1 (it drives the engine itself): the path v1 guests take."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "guests"))
    from build import HERE, build

    return build(HERE / "chat.c", tmp_path_factory.mktemp("guests"), ("FLOE_ABI_V1",), name="chat_v1")
