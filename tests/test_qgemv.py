"""floe's quantized GEMV, every instruction-set variant: exact against the dequantized weights,
chosen from the CPU's flags before anything is built, and the aarch64 variant cross-compiled."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from models import write_gguf
from toolchain import has_compiler

from floe.engine import cbuild, qgemv
from floe.errors import FloeError
from floe.model import load_checkpoint
from floe.model.quant import GROUP, QuantizedWeight


def runnable(name: str) -> str:
    """`name` if this machine can build and run it; else the test skips, saying what is missing."""
    why = qgemv.missing(name)
    if why:
        pytest.skip(f"the {name} kernel cannot run here: {why}")
    if not has_compiler():
        pytest.skip("no C++ compiler on this machine (native weights run PyTorch's packed int4 there)")
    return name


@pytest.fixture(params=list(qgemv.VARIANTS))
def variant(request) -> str:
    return runnable(request.param)


@pytest.fixture(scope="module", params=[Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K], ids=lambda t: t.name)
def tiny(request, tmp_path_factory):
    return load_checkpoint(write_gguf(tmp_path_factory.mktemp("qgemv") / "t.gguf", [request.param]))


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x with each group of 32 rounded to int8 steps of absmax / 127, as the kernels read it."""
    g = x.double().view(x.shape[0], -1, GROUP)
    step = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / step.clamp(min=1e-300)) * step).view(x.shape)


def assert_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y is x's int8 rounding times w, up to float rounding of the group sums."""
    exact = F.linear(int8_rounded(x), w.double())
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))


def test_every_variant_is_the_exact_linear_of_int8_rounded_inputs(tiny, variant):
    """The weights are the file's exactly and the integer dot products are exact: the one rounding
    is the input's, to int8 per group of 32 (what llama.cpp does too)."""
    torch.manual_seed(0)
    for name in ("layers.0.feed_forward.w2.weight", "layers.1.attention.wq.weight"):
        q, w = tiny.quantized[name], tiny.weights[name]
        layer = qgemv.QLinear(q, dense=False, kernel=variant)
        assert layer.kernel == variant
        x = torch.randn(3, q.shape[1])
        y = layer(x)
        assert_exact(y, x, w)
        assert (y.double() - F.linear(x.double(), w.double())).norm() / y.norm() < 2e-2


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_every_variant_on_wide_rows_with_a_tail(qtype, variant):
    """19 groups a row: two blocks of 8 (the unrolled loop) and a tail of 3; the file's blocks read in
    place, and (4-bit) the same weight as Q4_F blocks (Q4_K's float32 layout) gives the same outputs."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((37, 19 * GROUP)).astype(np.float32)
    q = QuantizedWeight(qtype.name, w.shape, quantize(w, qtype))
    layer = qgemv.QLinear(q, dense=False, kernel=variant)
    x = torch.from_numpy(rng.standard_normal((2, w.shape[1])).astype(np.float32))
    y = layer(x)
    assert_exact(y, x, q.dequantize())
    assert layer.blocks.data_ptr() == q.blocks.__array_interface__["data"][0]  # the file's bytes, no copy
    if qtype != Q.Q8_0:
        layer.blocks = qgemv.q4_f_blocks(q)
        assert layer.blocks.shape == (37, 19 * 24)
        torch.testing.assert_close(layer(x), y, rtol=1e-6, atol=1e-6 * float(y.abs().max()))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))


def test_every_variant_dequantizes_rows_as_the_file_holds_them(tiny, variant):
    """A prompt's bands of weight values come from the kernel in one pass: the file's values in
    float32 (a code times a file's scale is exact in float32, so the one rounding is the sum's) and
    those rounded to bfloat16 as PyTorch rounds, for a band of rows and for scattered rows
    (exact_top's); 4-bit weights also from their Q4_F blocks."""
    for name in ("layers.0.feed_forward.w2.weight", "layers.1.attention.wq.weight"):
        q = tiny.quantized[name]
        layer = qgemv.QLinear(q, dense=False, kernel=variant)
        exact = q.dequantize()
        layouts = [layer.blocks] + ([qgemv.q4_f_blocks(q)] if q.qtype != "Q8_0" else [])
        for blocks in layouts:
            layer.blocks = blocks
            for index in (slice(0, q.shape[0]), slice(3, 17), torch.tensor([9, 0, 5, 9])):
                values = layer.rows(index)
                assert torch.equal(values, exact[index]), name  # (as values: ±0 alike)
                assert same_bits(layer.rows(index, torch.bfloat16), values.bfloat16()), name


def test_bfloat16_rows_round_ties_to_even_as_pytorch(variant):
    """Q8_0 values d·q with q = ±2^k lie halfway between two bfloat16 values for d = 1 + 2^-8 (the even
    one below) and d = 1 + 3·2^-8 (the even one above): the kernel rounds them as PyTorch does."""
    q8 = np.arange(-128, 128, dtype=np.int8).reshape(4, 64)
    directions = set()
    for d in (1 + 2**-8, 1 + 3 * 2**-8):
        q = QuantizedWeight("Q8_0", q8.shape, q8_blocks(q8, d))
        layer = qgemv.QLinear(q, dense=False, kernel=variant)
        exact = layer.rows(slice(0, 4))
        rounded = layer.rows(slice(0, 4), torch.bfloat16)
        assert same_bits(rounded, exact.bfloat16())
        ties = (exact.view(torch.int32) & 0xFFFF) == 0x8000
        directions |= set((rounded.float().abs() > exact.abs())[ties].tolist())
    assert directions == {True, False}


def q8_blocks(q8: np.ndarray, d: float) -> np.ndarray:
    """Q8_0 bytes of int8 values q8 [rows, cols] with one scale d for every block."""
    rows, cols = q8.shape
    scale = np.full((rows, cols // GROUP, 1), d, np.float16).view(np.uint8)
    return np.concatenate([scale, q8.reshape(rows, -1, GROUP).view(np.uint8)], -1).reshape(rows, -1)


def test_byte_codes_at_their_extremes_do_not_saturate(variant):
    """AVX2's vpmaddubsw sums pairs of u8 x s8 products into a saturating int16: byte codes of 255
    (or, as signed values, -128) times inputs of ±127 are where an unsigned product would overflow."""
    q8 = np.where(np.arange(64) % 3 == 0, -128, 127).astype(np.int8)
    q8 = np.stack([q8, -q8.clip(-127), np.full(64, -128, np.int8), np.full(64, 127, np.int8)])
    q = QuantizedWeight("Q8_0", q8.shape, q8_blocks(q8, 0.5))
    layer = qgemv.QLinear(q, dense=False, kernel=variant)
    x = torch.tensor([[1.0, -1.0] * 32, [-1.0] * 64, [1.0] * 64])  # rounds to ±127 exactly
    assert_exact(layer(x), x, q.dequantize())


def test_4bit_codes_at_their_extremes(variant):
    codes = np.full((2, 32), 0xFF, np.uint8)  # Q4_0 nibbles of 15 everywhere
    codes[1, ::2] = 0x00
    blocks = np.concatenate([np.full((2, 2, 1), 0.25, np.float16).view(np.uint8),
                             codes.reshape(2, 2, 16)], -1).reshape(2, -1)
    q = QuantizedWeight("Q4_0", (2, 64), blocks)
    x = torch.tensor([[1.0] * 64, [-1.0, 1.0] * 32])
    assert_exact(qgemv.QLinear(q, dense=False, kernel=variant)(x), x, q.dequantize())


def banded(variant: str) -> str:
    """`variant` if it runs interleaved bands (csrc/qdot/abi.h); else the test skips."""
    if not qgemv.interleaves(qgemv.load(runnable(variant))):
        pytest.skip(f"the {variant} kernel reads the file's rows only (no interleaved bands)")
    return variant


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_interleaved_bands_are_the_exact_linear_of_int8_rounded_inputs(qtype, variant):
    """A weight of whole bands of 8 rows is held interleaved by a variant that has them: the same
    exact sums (every input count up to two of its row blocks and a tail: 1..9), each input row's
    outputs the same bits alone as beside others, and its rows' values (bands, slices, scattered
    rows, float32 and bfloat16) the file's; 4-bit weights also from Q4_F blocks (Q4_K's) in bands."""
    variant = banded(variant)
    rng = np.random.default_rng(7)
    w = rng.standard_normal((48, 19 * GROUP)).astype(np.float32)
    q = QuantizedWeight(qtype.name, w.shape, quantize(w, qtype))
    layer = qgemv.QLinear(q, dense=False, kernel=variant)
    assert layer.interleaved and layer.blocks.shape == (6, 8 * qgemv.kernel_blocks(q).shape[1])
    exact = q.dequantize()
    layouts = [layer.blocks]
    if qtype != Q.Q8_0:
        layouts.append(torch.ops.floe.interleave_q(qgemv.q4_f_blocks(q), w.shape[1]))
    for blocks in layouts:
        layer.blocks = blocks
        for m in range(1, 10):
            x = torch.from_numpy(rng.standard_normal((m, w.shape[1])).astype(np.float32))
            y = layer(x)
            assert_exact(y, x, exact)
            assert all(same_bits(layer(x[i:i + 1]), y[i:i + 1]) for i in range(m))
        for index in (slice(0, 48), slice(8, 24), slice(3, 17), slice(40, None), torch.tensor([9, 0, 47, 9])):
            values = layer.rows(index)
            assert torch.equal(values, exact[index])
            assert same_bits(layer.rows(index, torch.bfloat16), values.bfloat16())


@pytest.fixture(params=[1, 9], ids=["pairs-from-1-row", "pairs-from-9-rows"])
def pair_rows(request):
    """The input rows from which a variant with band pairs takes them (qgemv.pair_rows), set for the
    test: 1, every pass; 9, none (a pass has 8 rows at most); the machine's own restored after."""
    numbers = [qgemv.load(name) for name in qgemv.runnable() if qgemv.interleaves(qgemv.load(name))
               ] if has_compiler() else []
    before = [torch.ops.floe.qdot_pair_rows(n, 0) for n in numbers]
    for n in numbers:
        torch.ops.floe.qdot_pair_rows(n, request.param)
    yield request.param
    for n, rows in zip(numbers, before, strict=True):
        if rows:
            torch.ops.floe.qdot_pair_rows(n, rows)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_bands_taken_two_at_a_time_give_each_bands_own_bits(qtype, variant, pair_rows):
    """A variant may run neighbouring bands together (AVX-512 VNNI: 16 rows a 512-bit register, from
    qgemv.pair_rows() input rows on); every output is bitwise what its band gives alone (a weight of
    that one band), for 1..9 input rows, an odd number of bands (the last one alone), Q4_F blocks too,
    and extreme codes and inputs, with pairs from one input row on and with none."""
    variant = banded(variant)
    number = qgemv.load(variant)
    assert torch.ops.floe.qdot_pair_rows(number, 0) in ((pair_rows,) if variant == "vnni" else (0,))
    rng = np.random.default_rng(11)
    w = rng.standard_normal((40, 7 * GROUP)).astype(np.float32)
    w[:8, :GROUP] = np.where(np.arange(GROUP) % 2 == 0, 1e3, -1e3)  # codes at their extremes
    q = QuantizedWeight(qtype.name, w.shape, quantize(w, qtype))
    bands = [QuantizedWeight(qtype.name, (8, w.shape[1]), quantize(w[8 * b:8 * b + 8], qtype))
             for b in range(5)]
    whole = qgemv.QLinear(q, dense=False, kernel=variant)
    alone = [qgemv.QLinear(band, dense=False, kernel=variant) for band in bands]
    layouts = [(whole.blocks, [layer.blocks for layer in alone])]
    if qtype != Q.Q8_0:
        layouts.append((torch.ops.floe.interleave_q(qgemv.q4_f_blocks(q), w.shape[1]),
                        [torch.ops.floe.interleave_q(qgemv.q4_f_blocks(band), w.shape[1]) for band in bands]))
    for blocks, band_blocks in layouts:
        whole.blocks = blocks
        for layer, own in zip(alone, band_blocks, strict=True):
            layer.blocks = own
        for m in range(1, 10):
            x = torch.from_numpy(rng.standard_normal((m, w.shape[1])).astype(np.float32))
            x[0, :GROUP] = 127.0  # rounds to +127, its group's others to 0
            y = whole(x)
            assert all(same_bits(y[:, 8 * b:8 * b + 8], layer(x)) for b, layer in enumerate(alone))


def test_interleaved_codes_at_their_extremes_do_not_saturate(variant):
    """In bands, AVX2 adds a group's eight int16 pair sums of 4-bit codes before widening them, and
    byte codes go through |q| x sign(x, q): codes of 15 and 0, bytes of -128 and 127, inputs of ±127."""
    variant = banded(variant)
    nibbles = np.full((8, 64), 0xFF, np.uint8)
    nibbles[1::2, ::2] = 0x00
    blocks = np.concatenate([np.full((8, 4, 1), 0.25, np.float16).view(np.uint8),
                             nibbles.reshape(8, 4, 16)], -1).reshape(8, -1)
    q8 = np.where(np.arange(128) % 3 == 0, -128, 127).astype(np.int8)
    q8 = np.stack([q8, -q8.clip(-127), np.full(128, -128, np.int8), np.full(128, 127, np.int8)] * 2)
    x = torch.tensor([[1.0, -1.0] * 64, [-1.0] * 128, [1.0] * 128])  # rounds to ±127 exactly
    q4 = QuantizedWeight("Q4_0", (8, 128), blocks)
    for q in (q4, QuantizedWeight("Q8_0", q8.shape, q8_blocks(q8, 0.5))):
        layer = qgemv.QLinear(q, dense=False, kernel=variant)
        assert layer.interleaved
        assert_exact(layer(x), x, q.dequantize())


def test_band_pairs_start_where_the_cpu_runs_them_faster(monkeypatch):
    """Intel's AVX-512 cores run a 512-bit operation whole: pairs from one input row; AMD's Zen 4 runs it
    as two 256-bit halves: from four (qgemv.pair_rows); FLOE_QDOT_PAIR_ROWS sets it, a bad value refused."""
    monkeypatch.delenv("FLOE_QDOT_PAIR_ROWS", raising=False)
    monkeypatch.setattr(qgemv, "cpu_vendor", lambda: "GenuineIntel")
    assert qgemv.pair_rows() == 1
    monkeypatch.setattr(qgemv, "cpu_vendor", lambda: "AuthenticAMD")
    assert qgemv.pair_rows() == 4
    monkeypatch.setenv("FLOE_QDOT_PAIR_ROWS", "2")
    assert qgemv.pair_rows() == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("FLOE_QDOT_PAIR_ROWS", bad)
        with pytest.raises(FloeError, match="FLOE_QDOT_PAIR_ROWS"):
            qgemv.pair_rows()


def test_auto_takes_the_best_variant_the_cpu_flags_name(monkeypatch):
    monkeypatch.setattr(qgemv.platform, "machine", lambda: "x86_64")
    avx2 = frozenset({"sse2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"})
    monkeypatch.setattr(qgemv, "cpu_flags", lambda: avx2)
    assert qgemv.runnable() == ["avx2", "portable"]
    assert qgemv.missing("vnni") == "this CPU lacks avx512_vnni"
    monkeypatch.setattr(qgemv, "cpu_flags", lambda: avx2 | {"avx512_vnni"})
    assert qgemv.runnable() == ["vnni", "avx2", "portable"]
    monkeypatch.setattr(qgemv, "cpu_flags", lambda: frozenset({"sse2"}))
    assert qgemv.runnable() == ["portable"]
    assert "aarch64" in qgemv.missing("neon")


@pytest.mark.skipif(qgemv.platform.machine() not in qgemv.X86, reason="x86 flags")
def test_flags_the_process_cannot_execute_are_not_taken_from_proc_cpuinfo(monkeypatch):
    """Under an emulator (qemu-user -cpu EPYC-Rome) /proc/cpuinfo is the host's: CPUID, as PyTorch
    reads it, decides the x86 vector extensions, so no variant is chosen that would fault."""
    import torch.cpu

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    assert not any(f.startswith("avx512") for f in qgemv.cpu_flags())
    assert "vnni" not in qgemv.runnable()
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: False)
    assert qgemv.runnable() == ["portable"]


def test_a_variant_the_cpu_cannot_run_is_refused_before_anything_is_built(monkeypatch):
    monkeypatch.setattr(qgemv.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(qgemv, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma"}))
    monkeypatch.setattr(qgemv, "_numbers", {})

    def no_build(*args, **kwargs):
        raise AssertionError("a build was started for a kernel this CPU cannot run")

    monkeypatch.setattr(cbuild, "build", no_build)
    monkeypatch.setattr(cbuild, "build_plain", no_build)
    for name, flag in (("vnni", "avx512_vnni"), ("avx2", "f16c")):
        with pytest.raises(qgemv.KernelUnavailable, match=f"the {name} kernel cannot run here: .*{flag}"):
            qgemv.load(name)


def test_each_variant_builds_apart_with_its_own_flags():
    """One library per variant, in a folder named by its sources and flags: none is -march=native."""
    folders = set()
    for variant in qgemv.VARIANTS.values():
        assert not any("native" in flag for flag in variant.cflags)
        folders.add(cbuild._folder(f"floe_qdot_{variant.name}", [variant.source], list(variant.cflags))[0])
    assert len(folders) == len(qgemv.VARIANTS)


def zig_cxx(target: str, cpu: str, source, out) -> subprocess.CompletedProcess:
    """Cross-compile `source` with zig's clang (pip's ziglang) for `target`."""
    return subprocess.run([sys.executable, "-m", "ziglang", "c++", "-std=c++17", "-O3", "-Wall", "-Werror",
                           "-target", target, f"-mcpu={cpu}", "-c", str(source), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name,cpu", [("neon", "generic+dotprod"), ("portable", "generic")])
def test_the_aarch64_kernels_compile(name, cpu, tmp_path):
    """The NEON variant is compiled here, not run: its core is free of PyTorch, so zig's clang
    cross-compiles it for aarch64 (armv8.2-a+dotprod, spelt -mcpu=generic+dotprod for zig)."""
    pytest.importorskip("ziglang", reason="no cross-compiler here (pip install ziglang)")
    out = tmp_path / f"{name}.o"
    proc = zig_cxx("aarch64-linux-gnu", cpu, qgemv.VARIANTS[name].source, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    elf = out.read_bytes()
    assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 183  # EM_AARCH64
    assert b"floe_qdot_kernel" in elf


def test_the_neon_kernel_needs_the_dot_product_extension(tmp_path):
    """Without +dotprod the NEON source does not compile: its flags are what makes it that variant."""
    pytest.importorskip("ziglang", reason="no cross-compiler here (pip install ziglang)")
    proc = zig_cxx("aarch64-linux-gnu", "generic", qgemv.VARIANTS["neon"].source, tmp_path / "n.o")
    assert proc.returncode != 0 and "dotprod" in proc.stderr


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_a_head_with_exact_top_keeps_the_float32_argmax(qtype, variant):
    """A vocabulary head of near-tied rows: the int8 rounding of the input moves each output by no
    more than the layer's bound, and with exact_top every output that could be the largest is the
    float32 product's, so the argmax is float32's even where the int8 kernel alone picks another."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal((1, 8 * GROUP)).astype(np.float32)
    w = np.repeat(base, 2000, 0) + 0.2 * rng.standard_normal((2000, 8 * GROUP)).astype(np.float32)
    q = QuantizedWeight(qtype.name, w.shape, quantize(w, qtype))
    plain = qgemv.QLinear(q, dense=False, kernel=variant)
    head = qgemv.QLinear(q, dense=False, kernel=variant, exact_top=True)
    dense = q.dequantize().double()
    flips = 0
    for seed in range(100):
        x = torch.from_numpy(np.random.default_rng(seed).standard_normal((2, w.shape[1])).astype(np.float32))
        exact, rounded, y = F.linear(x.double(), dense), plain(x), head(x)
        bound = (x.view(2, -1, GROUP).abs().amax(-1).sum(-1, keepdim=True) * head.rounding_bound).double()
        assert ((rounded.double() - exact).abs() <= bound).all()
        assert torch.equal(y.argmax(-1), exact.argmax(-1))
        top = exact.argmax(-1, keepdim=True)
        torch.testing.assert_close(y.double().gather(1, top), exact.gather(1, top), rtol=1e-6, atol=1e-5)
        flips += int((rounded.argmax(-1) != exact.argmax(-1)).sum())
    assert flips > 0  # the kernel alone picks another row somewhere: the test can tell them apart


def test_outputs_do_not_depend_on_the_thread_count_or_the_calling_thread(variant):
    """floe's pool cuts a call into chunks that any thread may take: every output row is computed
    alone, so 1 or 2 threads, or a call from another Python thread (the engine loop's), give the
    same bits; so do several threads calling at once (the pool runs one call at a time). gemm_q (a
    prompt's float32 product, on PyTorch's threads) too, at 1 and 2 threads and from other threads."""
    import threading

    rng = np.random.default_rng(11)
    w = rng.standard_normal((1000, 4 * GROUP)).astype(np.float32)
    q = QuantizedWeight("Q4_1", w.shape, quantize(w, Q.Q4_1))
    layer = qgemv.QLinear(q, dense=False, kernel=variant)
    xs = [torch.from_numpy(rng.standard_normal((rows, w.shape[1])).astype(np.float32))
          for rows in (1, 3, 1, 7)]
    before = torch.get_num_threads()
    try:
        prompt = torch.from_numpy(rng.standard_normal((13, w.shape[1])).astype(np.float32))

        def product() -> torch.Tensor:
            return torch.ops.floe.gemm_q(prompt, layer.blocks, layer.number)

        torch.set_num_threads(1)
        alone = [layer(x) for x in xs]
        rows_alone = [layer.rows(slice(0, 1000)) for _ in range(2)]
        product_alone = product()
        torch.set_num_threads(2)
        assert all(same_bits(layer(x), y) for x, y in zip(xs, alone, strict=True))
        assert same_bits(layer.rows(slice(0, 1000)), rows_alone[0])
        assert same_bits(product(), product_alone)
        results: dict[int, list] = {}

        products: dict[int, list] = {}

        def calls(index: int) -> None:
            results[index] = [layer(xs[(index + j) % len(xs)]) for j in range(40)]
            products[index] = [product() for _ in range(5)]

        threads = [threading.Thread(target=calls, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for index, ys in results.items():
            assert all(same_bits(y, alone[(index + j) % len(xs)]) for j, y in enumerate(ys))
        assert len(results) == 4 and len(products) == 4
        assert all(same_bits(y, product_alone) for ys in products.values() for y in ys)
    finally:
        torch.set_num_threads(before)


def test_a_forked_child_gets_a_pool_of_its_own():
    """A child forked after the pool's workers started has none of them: it starts from a new pool
    (pthread_atfork), whose worker it makes again, and its calls on two threads give the parent's
    bits. (A fork while another thread is inside a call cannot be staged from Python: an operator
    call holds the GIL that os.fork needs.)"""
    import os

    name = runnable(qgemv.runnable()[0])
    rng = np.random.default_rng(12)
    w = rng.standard_normal((4096, 2 * GROUP)).astype(np.float32)
    q = QuantizedWeight("Q8_0", w.shape, quantize(w, Q.Q8_0))
    layer = qgemv.QLinear(q, dense=False, kernel=name)
    x = torch.from_numpy(rng.standard_normal((2, w.shape[1])).astype(np.float32))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        y = layer(x)  # the workers exist now
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no test framework here, only what it writes and its exit status
            ok = all(same_bits(layer(x), y) for _ in range(3))
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        os.close(write)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's call never finished")
        assert os.read(read, 1) == b"1" and done[1] == 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_a_prompts_float32_product_is_each_rows_own_dot_products(qtype, variant):
    """gemm_q (a short prompt's product where the GEMM runs in float32: floe.engine.prefill) on the
    file's rows (39: a last band of 7, its weight rows in tiles of 4, 2 and 1) and on interleaved bands,
    4-bit weights also from Q4_F blocks: the float32 product of x and the file's values (dequant_q's)
    up to float rounding, and each row's outputs the same bits whatever rows are beside it (1..13 rows:
    tiles of 3 and 6 input rows and their tails), where a PyTorch GEMM's rounding may depend on the row
    count."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((39, 19 * GROUP)).astype(np.float32)
    q = QuantizedWeight(qtype.name, w.shape, quantize(w, qtype))
    layer = qgemv.QLinear(q, dense=False, kernel=variant)
    layouts = [layer.blocks] + ([qgemv.q4_f_blocks(q)] if qtype != Q.Q8_0 else [])
    if qgemv.interleaves(layer.number):  # (whole bands: the first 32 rows)
        q32 = QuantizedWeight(qtype.name, (32, w.shape[1]), quantize(w[:32], qtype))
        layouts.append(torch.ops.floe.interleave_q(qgemv.kernel_blocks(q32), w.shape[1]))
    x = torch.from_numpy(rng.standard_normal((13, w.shape[1])).astype(np.float32))
    for blocks in layouts:
        values = torch.ops.floe.dequant_q(blocks, w.shape[1], torch.float32, layer.number)
        exact = F.linear(x.double(), values.double())
        for m in range(1, 14):
            y = torch.ops.floe.gemm_q(x[:m], blocks, layer.number)
            assert y.shape == (m, values.shape[0]) and y.dtype == torch.float32
            torch.testing.assert_close(y.double(), exact[:m], rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
            assert all(same_bits(torch.ops.floe.gemm_q(x[i:i + 1], blocks, layer.number), y[i:i + 1])
                       for i in range(m))
