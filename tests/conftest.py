import os
import sys
from pathlib import Path

import pytest

from floe.cli.machine import polite_openmp

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray's clusters in the tests report to no one
# OpenMP threads that spin briefly, as `floe` sets them (floe.cli.machine.polite_openmp): the suite's
# servers and clients share its cores, where a long spin slows every prompt several times.
polite_openmp()
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def default_checkpoint():
    from floe.model import load_checkpoint

    return dequantized_once(load_checkpoint())


def dequantized_once(checkpoint):
    """`checkpoint`, its block-quantized weights dequantized once per dtype for the whole session and
    each engine given a copy of its own (the same values): a float32 engine of the default model
    dequantized them again at every start, ~1.5-3 s each of the many such starts in the suite."""
    from floe.model.checkpoint import LazyWeights

    weights = checkpoint.weights
    if not isinstance(weights, LazyWeights):
        return checkpoint
    done: dict = {}

    def once(name: str):
        def load(dtype):
            if (name, dtype) not in done:
                done[name, dtype] = weights.load(name, dtype)
            return done[name, dtype].clone()
        return load

    checkpoint.weights = LazyWeights({name: once(name) if name in checkpoint.quantized
                                      else lambda dtype, name=name: weights.load(name, dtype)
                                      for name in weights}, weights.dtype)
    return checkpoint


@pytest.fixture(scope="session")
def default_engine(default_checkpoint):
    from floe.engine import Engine

    return Engine(default_checkpoint, max_seq_len=2048)


@pytest.fixture(scope="session")
def native_engine(default_checkpoint):
    """The default model as `floe run` and `floe serve` run it on a CPU: the GGUF's own 4/8-bit weights,
    a decode step ~5x quicker than default_engine's float32 (for tests whose replies need not be those
    of float32: a prompt's products and a decode step's differ by ~1e-2 here)."""
    from floe.engine import Engine

    return Engine(default_checkpoint, max_seq_len=2048, n_slots=2, weights="native")


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


@pytest.fixture(scope="module")
def s3():
    """A real S3 API on loopback (moto's threaded server): s3fs options that reach it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield {"key": "test", "secret": "test",
           "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"}}
    server.stop()


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


@pytest.fixture(autouse=True)
def _torch_threads_as_found():
    """A test that runs a command in this process (floe.cli.main: `floe run` sets torch's threads to the
    cores idle at that moment) leaves the run's thread count as it found it: one such test at a busy
    moment left every later test on one thread."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def pytest_configure(config):
    """PyTorch's CPU threads for this run: the cores idle now. A thread on a core another process keeps
    busy makes every parallel op wait for it (decode ~50x slower on a busy 2-core machine), as
    `floe run` avoids the same way (floe.cli.idle_cpus)."""
    import torch

    from floe.cli import idle_cpus

    torch.set_num_threads(idle_cpus())


def pytest_report_header(config):
    """What this run's kernels and timings depend on: the CPU, the variants it runs, the threads."""
    import platform

    import torch

    from floe.engine import qgemv

    flags = sorted(f for f in qgemv.cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c", "asimd")))
    return [f"floe: {platform.machine()}, kernels {', '.join(qgemv.runnable())}; "
            f"torch {torch.__version__} on {torch.get_num_threads()} threads; flags {' '.join(flags)}"]
