"""Weights mapped, not copied: `floe run`'s peak resident memory (VmHWM of a fresh process) is the
torch runtime plus about the file, and what stays in the file is proven by addresses, not assumed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from models import _add_field, save_hf_folder, tokenizer_fields, write_gguf
from toolchain import has_compiler

from floe.engine import Engine
from floe.engine.transformer import QuantizedEmbedding
from floe.model import load_checkpoint

# Llama-3.2-1B's shape (its real vocabulary size; SmolLM2's tokenizer covers the first 49152 ids).
SHAPE_1B = dict(dim=2048, n_layers=16, n_heads=32, n_kv=8, ffn=8192, vocab=128256)
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}


def peak_rss(code: str, *argv: str) -> dict:
    """Run `code` in a fresh interpreter; its exit status, stdout and peak resident memory (VmHWM,
    bytes), read from /proc/self/status as it ends."""
    report = ("import re as _re, sys as _sys\n"
              "_s = open('/proc/self/status').read()\n"
              "print('VMHWM', int(_re.search(r'VmHWM:\\s+(\\d+)', _s).group(1)) * 1024, file=_sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", f"{code}\n{report}", *argv], capture_output=True, text=True,
                          env=ENV, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("VMHWM"))
    return {"stdout": proc.stdout, "vmhwm": int(line.split()[1])}


RUN = "import sys\nfrom floe.cli import main\nrc = main(sys.argv[1:])\nassert rc == 0, rc\n"
# What `floe run` holds before any weight: torch, floe's modules, the native kernel library.
RUNTIME = ("import torch, floe.cli, floe.actor, floe.engine, floe.model, floe.engine.cpu_decode\n"
           "from floe.engine import qgemv\nqgemv.load('auto')\n")


@pytest.fixture(scope="session")
def runtime_bytes() -> int:
    return peak_rss(RUNTIME)["vmhwm"]


def test_floe_run_on_the_default_model_peaks_under_408_mb():
    """Measured before: 1.26-2.0 GB (a float32 checkpoint, bf16 prefill copies, the whole KV cache
    written by torch.zeros); then 419 MB; then 405-407 MB on the Xeon, 392-393 on an AVX2 Zen 3 (the
    chat guest loaded compiled, not run through Cranelift; rich, safetensors and the snapshot format not
    imported); now 388-389 on the Zen 3 (no setuptools imported to name the kernels' build folder; the
    vocabulary's strings kept as the file's bytes), of which 248 MB is torch and floe's modules and 96 MB
    the weights (docs/PERF.md, "Memory (peak RSS)"). The bound leaves the Xeon (AMX and AVX-512 paths:
    11-12 MB above the Zen 3 until now, so ~402-404 MB, not re-measured) the 4-6 MB margin it had
    under 411 MB: runs differ by ~1 MB, and what came off here (setuptools, the vocabulary's strings)
    does not depend on the CPU."""
    from floe.actor import builtin_guest
    from floe.wasm.runtime import default_runtime

    default_runtime().compile(builtin_guest("chat"))  # kept compiled (floe.wasm.runtime), as after any run
    r = peak_rss(RUN, "run", "What is the capital of France?", "--max-tokens", "8", "--threads", "2",
                 "--context", "256", "--json")
    assert "Paris" in json.loads(r["stdout"])["text"]
    assert r["vmhwm"] <= 408e6, f"peak RSS {r['vmhwm'] / 1e6:.0f} MB"


def write_q4_0_gguf(path: Path, dim: int, n_layers: int, n_heads: int, n_kv: int, ffn: int, vocab: int,
                    context: int = 2048, seed: int = 0) -> Path:
    """A Llama GGUF of this shape, every matrix Q4_0 (random codes, fp16 scales ~0.002), tied
    embeddings, written a tensor at a time (never the whole file in memory)."""
    rng = np.random.default_rng(seed)
    hd = dim // n_heads
    writer = GGUFWriter(path, "llama")
    writer.add_name("q4-0-memory-test")
    for add, value in ((writer.add_block_count, n_layers), (writer.add_context_length, context),
                       (writer.add_embedding_length, dim), (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count, n_heads), (writer.add_head_count_kv, n_kv),
                       (writer.add_rope_freq_base, 500000.0), (writer.add_layer_norm_rms_eps, 1e-5),
                       (writer.add_rope_dimension_count, hd), (writer.add_vocab_size, vocab)):
        add(value)
    for key, value in tokenizer_fields().items():
        _add_field(writer, key, value)
    matrices = {"token_embd.weight": (vocab, dim)}
    for i in range(n_layers):
        p = f"blk.{i}."
        matrices.update({p + "attn_q.weight": (dim, dim), p + "attn_k.weight": (n_kv * hd, dim),
                         p + "attn_v.weight": (n_kv * hd, dim), p + "attn_output.weight": (dim, dim),
                         p + "ffn_gate.weight": (ffn, dim), p + "ffn_up.weight": (ffn, dim),
                         p + "ffn_down.weight": (dim, ffn)})
    norms = ["output_norm.weight"]
    norms += [f"blk.{i}.{n}_norm.weight" for i in range(n_layers) for n in ("attn", "ffn")]
    for name, (rows, cols) in matrices.items():
        nbytes = rows * cols // 32 * 18
        writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, Q.Q4_0)
    for name in norms:
        writer.add_tensor_info(name, (dim,), np.dtype(np.float32), 4 * dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for rows, cols in matrices.values():
        blocks = rng.integers(0, 256, size=(rows * cols // 32, 18), dtype=np.uint8)
        scales = (0.0015 + 0.001 * rng.random(len(blocks))).astype(np.float16)
        blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
        writer.write_tensor_data(blocks.reshape(rows, -1))
    for _ in norms:
        writer.write_tensor_data(np.ones(dim, dtype=np.float32))
    writer.close()
    return path


@pytest.fixture(scope="session")
def q4_0_1b(tmp_path_factory) -> Path:
    """Llama-3.2-1B's shape in Q4_0 (~0.7 GB), written once per test session."""
    return write_q4_0_gguf(tmp_path_factory.mktemp("q4_0_1b") / "llama-1b-q4_0.gguf", **SHAPE_1B)


@pytest.mark.slow
def test_floe_run_on_a_1b_q4_0_file_peaks_at_the_file_plus_kv_and_runtime(q4_0_1b, runtime_bytes):
    """llama.cpp maps the file (RSS ~ file size), and floe holds one copy of the weights too: its
    kernel reads the file's Q4_0 blocks in place or (x86) interleaved 8 rows a band, a copy whose
    source pages are given back (stacked and re-ordered matrices: one copy, the file's pages left),
    and the 4-bit prefill dequantizes one band at a time. Measured: file + KV + runtime + 74 MB
    (tokenizer, guest, TorchScript); with the kernel's own layout (20 bytes per 18): + 190 MB; with a
    float32 checkpoint: ~12 GB."""
    context, layers = 256, SHAPE_1B["n_layers"]
    head_dim = SHAPE_1B["dim"] // SHAPE_1B["n_heads"]
    kv_bytes = 2 * layers * SHAPE_1B["n_kv"] * head_dim * context * 4  # float32 K and V, every position
    r = peak_rss(RUN, "run", "What is the capital of France?", "--model", str(q4_0_1b), "--max-tokens",
                 "4", "--threads", "2", "--context", str(context), "--json")
    record = json.loads(r["stdout"])
    assert record["weights"]["quantized"] == {"Q4_0": 1 + 4 * layers}  # every matrix as the file has it
    file_bytes = q4_0_1b.stat().st_size
    bound = file_bytes + kv_bytes + runtime_bytes + 100e6
    assert r["vmhwm"] <= bound, (f"peak RSS {r['vmhwm'] / 1e6:.0f} MB > {bound / 1e6:.0f} MB (file "
                                 f"{file_bytes / 1e6:.0f} MB, runtime {runtime_bytes / 1e6:.0f} MB)")


def mapped_file(t: torch.Tensor | np.ndarray) -> str | None:
    """The file whose mapping holds the first byte of `t` (per /proc/self/maps), None if anonymous."""
    address = t.data_ptr() if isinstance(t, torch.Tensor) else t.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                named = len(fields) == 6 and fields[5].startswith("/")
                return os.path.realpath(fields[5].strip()) if named else None
    return None


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("mapped") / "t.gguf", [Q.Q8_0])


def test_a_float32_matrix_of_a_gguf_is_a_view_of_the_file_for_a_float32_engine(tmp_path):
    path = write_gguf(tmp_path / "f32.gguf", [Q.F32])
    checkpoint = load_checkpoint(path)
    assert mapped_file(checkpoint.weights["output.weight"]) == os.path.realpath(path)
    assert mapped_file(checkpoint.weight("output.weight", torch.bfloat16)) is None  # converted: a copy
    assert mapped_file(checkpoint.weights["norm.weight"]) is None  # 1 KB: cheaper copied than mapped
    engine = Engine(checkpoint, max_seq_len=32)
    assert mapped_file(engine.model.output.weight) == os.path.realpath(path)
    assert mapped_file(engine.model.tok_embeddings.weight) == os.path.realpath(path)


def test_quantized_weights_are_views_of_the_file(tiny_q8):
    quantized = load_checkpoint(tiny_q8).quantized
    assert mapped_file(quantized["layers.0.attention.wo.weight"].blocks) == os.path.realpath(tiny_q8)
    assert mapped_file(quantized["layers.0.attention.wq.weight"].blocks) is None  # rows un-permuted: a copy


def test_native_layers_read_the_files_blocks_in_place(tiny_q8):
    """The portable kernel's weight is the file's memory map; a stacked matrix (gate and up) is one
    copy of the file's blocks, byte for byte, not another layout."""
    from floe.engine.qgemv import QLinear

    if not has_compiler():
        pytest.skip("no C++ compiler: native weights run PyTorch's packed int4 here")
    checkpoint = load_checkpoint(tiny_q8)
    layer = Engine(checkpoint, max_seq_len=32, weights="native", native_kernel="portable").model.layers[0]
    for module in (layer.attention.wo, layer.feed_forward.w2):
        assert isinstance(module, QLinear) and mapped_file(module.blocks) == os.path.realpath(tiny_q8)
    gate_up = [checkpoint.quantized[f"layers.0.feed_forward.{n}.weight"].blocks for n in ("w1", "w3")]
    stacked = np.concatenate(gate_up)
    assert mapped_file(layer.feed_forward.w13.blocks) is None
    assert np.array_equal(layer.feed_forward.w13.blocks.numpy(), stacked)


def test_native_layers_in_bands_hold_the_files_blocks_interleaved(tiny_q8):
    """A variant with interleaved bands holds each matrix of whole bands as the file's blocks, 8 rows
    interleaved (torch.ops.floe.interleave_q), byte for byte: a copy in place of the mapping, whose
    pages the load gave back (a later read maps them from the file again)."""
    from floe.engine import qgemv

    if not has_compiler():
        pytest.skip("no C++ compiler: native weights run PyTorch's packed int4 here")
    name = qgemv.runnable()[0]
    if not qgemv.interleaves(qgemv.load(name)):
        pytest.skip(f"the {name} kernel reads the file's rows only")
    checkpoint = load_checkpoint(tiny_q8)
    layer = Engine(checkpoint, max_seq_len=32, weights="native").model.layers[0]
    f = layer.feed_forward
    for module, parts in ((layer.attention.wo, ("attention.wo",)), (f.w2, ("feed_forward.w2",)),
                          (f.w13, ("feed_forward.w1", "feed_forward.w3"))):
        blocks = np.concatenate([checkpoint.quantized[f"layers.0.{p}.weight"].blocks for p in parts])
        assert module.interleaved and mapped_file(module.blocks) is None
        expected = torch.ops.floe.interleave_q(torch.from_numpy(blocks), module.in_features)
        assert torch.equal(module.blocks, expected)


def test_native_embeddings_are_looked_up_in_the_file(tiny_q8):
    checkpoint = load_checkpoint(tiny_q8)
    engine = Engine(checkpoint, max_seq_len=32, weights="native")
    table = engine.model.tok_embeddings
    assert isinstance(table, QuantizedEmbedding)
    assert mapped_file(table.table.blocks) == os.path.realpath(tiny_q8)
    ids = torch.tensor([0, 7, 49151, 7])
    assert torch.equal(table(ids), checkpoint.weights["tok_embeddings.weight"][ids])


def test_a_hf_folder_in_the_engines_dtype_is_mapped_not_copied(tmp_path):
    folder = save_hf_folder(tmp_path / "hf", "llama", tie=False, shard=False)
    engine = Engine(load_checkpoint(folder), max_seq_len=32)  # the folder stores float32
    weights = engine.model.tok_embeddings.weight, engine.model.output.weight
    assert all(mapped_file(w) == os.path.realpath(folder / "model.safetensors") for w in weights)
    assert mapped_file(engine.model.layers[1].attention.wqkv.weight) is None  # stacked once: a copy
    assert mapped_file(engine.model.layers[1].attention.wo.weight) is None  # 16 KB: copied


def test_a_checkpoint_keeps_no_tensor_it_hands_out(tiny_q8):
    """Each read is new (or a view of the file): nothing dequantized stays behind in the checkpoint."""
    checkpoint = load_checkpoint(tiny_q8)
    a, b = (checkpoint.weights["layers.1.feed_forward.w2.weight"] for _ in range(2))
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_a_prompt_on_quantized_layers_runs_as_with_a_stored_bf16_copy(tmp_path, qtype):
    """No stored copy: each matrix is dequantized from the kernel's codes (a band at a time, or into
    the core's cache for a short prompt where the GEMM is float32: floe.engine.prefill), to the values
    the copy held, and the prompt's logits are the copy's up to float rounding (the products' sums in
    another order: ~1e-6 of logits that reach ~1,000 on this random model)."""
    from floe.engine.qgemv import QLinear

    checkpoint = load_checkpoint(write_gguf(tmp_path / "t.gguf", [qtype]))
    banded = Engine(checkpoint, max_seq_len=64, weights="native")
    stored = Engine(checkpoint, max_seq_len=64, weights="native", prefill_copy=True)
    layer, copy = banded.model.layers[1].feed_forward.w13, stored.model.layers[1].feed_forward.w13
    assert isinstance(layer, QLinear) and layer.dense is None and copy.dense is not None
    assert torch.equal(layer.rows(slice(None), copy.dense.dtype), copy.dense)
    ids = list(range(100, 140))  # the bands' products may block their sums otherwise: float rounding only
    torch.testing.assert_close(banded.prefill(ids, all_logits=True), stored.prefill(ids, all_logits=True),
                               rtol=5e-6, atol=1e-4)
