"""Probe (H200, issue 22): the prompt graph's flash attention (triton_kernels.flash_prompt_attention)
per tile configuration against cuDNN's causal SDPA at the 1B (hd 64) and 8B (hd 128) shapes, 2,048 rows.
Run: PYTHONPATH=src python bench/probes/prompt_attention_configs.py"""
import torch
import torch.nn.functional as F

from floe.engine import triton_kernels as tk

T = 2048
CONFIGS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 2),
           (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 2), (128, 128, 8, 3)]


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def probe(hd: int, heads: int = 32, kv_heads: int = 8) -> None:
    q = torch.randn(T, heads, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, kv_heads, 2304, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pos = torch.arange(T, device="cuda")
    slots = torch.zeros(T, dtype=torch.long, device="cuda")
    qs, ks, vs = q.transpose(0, 1)[None], k[0:1, :, :T], v[0:1, :, :T]

    def sdpa():
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

    ref = sdpa()
    print(f"hd={hd}: sdpa (cudnn) {timed(sdpa):.3f} ms")
    for cfg in CONFIGS:
        try:
            out = tk.flash_prompt_attention(q, k, v, pos, slots, kv_heads, cfg)
            err = (out.view(T, heads, hd).transpose(0, 1).float() - ref[0].float()).abs().max().item()
            ms = timed(lambda cfg=cfg: tk.flash_prompt_attention(q, k, v, pos, slots, kv_heads, cfg))
            print(f"  {cfg}: {ms:.3f} ms  max err {err:.3g}")
        except Exception as e:  # noqa: BLE001 - a configuration this device cannot compile
            print(f"  {cfg}: failed {str(e).splitlines()[0][:120]}")


if __name__ == "__main__":
    for head_dim in (64, 128):
        probe(head_dim)
