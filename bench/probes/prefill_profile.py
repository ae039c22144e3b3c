"""Probe (H200, issue 22): where a 2,048-token prefill's time goes — the engine's prefill timed, one
run under torch.profiler (top kernels by device time), and SDPA's backends alone at the same shape.
Run: PYTHONPATH=src FLOE_TEST_TOKENIZER=DIR python bench/probes/prefill_profile.py [SHAPE ...]"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from floe.cli import _tokenizer
from floe.engine import Engine
from floe.model.synthetic import random_checkpoint

N = 2048
BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
            ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)]


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


def probe(shape: str, tok) -> None:
    engine = Engine(random_checkpoint(shape, tok, dtype=torch.bfloat16, device="cuda"), device="cuda",
                    dtype="bfloat16", max_seq_len=2304, n_slots=2)
    c = engine.config
    ids = list(range(100, 100 + N))

    def run():
        engine.kv_truncate(0)
        engine.prefill(ids)

    with torch.inference_mode():
        print(f"{shape}: prefill {N} = {timed(run):.2f} ms", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
        q = torch.randn(1, c.n_heads, N, c.head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, c.n_kv_heads, N, c.head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        groups = c.n_heads // c.n_kv_heads
        for name, backend in BACKENDS:
            for gqa in (True, False):
                kk, vv = (k, v) if gqa else (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))
                try:
                    with sdpa_kernel(backend):
                        t = timed(lambda kk=kk, vv=vv, gqa=gqa: F.scaled_dot_product_attention(
                            q, kk, vv, is_causal=True, enable_gqa=gqa))
                    print(f"  sdpa {name:9} gqa={gqa!s:5} {t:.3f} ms/layer x{c.n_layers} = "
                          f"{t * c.n_layers:.2f} ms")
                except Exception as e:  # noqa: BLE001 - a backend this device or shape lacks
                    print(f"  sdpa {name:9} gqa={gqa!s:5} unavailable: {str(e).splitlines()[0][:100]}")
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            try:
                print(f"  engine prefill forced flash: {timed(run):.2f} ms")
            except Exception as e:  # noqa: BLE001
                print("  forced flash failed:", str(e).splitlines()[0][:150])


if __name__ == "__main__":
    tokenizer = _tokenizer(os.environ["FLOE_TEST_TOKENIZER"])
    for shape_name in sys.argv[1:] or ["llama-3.2-1b", "llama-3-8b"]:
        probe(shape_name, tokenizer)
        torch.cuda.empty_cache()
