"""Probe (H200, issue 22): the prompt graph's flash attention (triton_kernels.flash_prompt_attention)
per tile configuration against cuDNN's causal SDPA at the 1B (hd 64) and 8B (hd 128) shapes, 2,048 rows.
Run: PYTHONPATH=src python bench/probes/prompt_attention_configs.py"""
import torch
import torch.nn.functional as F
from floe.engine import triton_kernels as tk

def timed(fn, reps=20):
    for _ in range(3): fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]

T = 2048
for hd in (64, 128):
    H, KV = 32, 8
    q = torch.randn(T, H, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, KV, 2304, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pos = torch.arange(T, device="cuda"); slots = torch.zeros(T, dtype=torch.long, device="cuda")
    qs, ks, vs = q.transpose(0, 1)[None], k[0:1, :, :T], v[0:1, :, :T]
    ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    print(f"hd={hd}: sdpa (cudnn) {timed(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)):.3f} ms")
    for cfg in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3),
                (128, 32, 4, 3), (64, 128, 4, 2), (128, 128, 8, 3)]:
        try:
            out = tk.flash_prompt_attention(q, k, v, pos, slots, KV, cfg)
            err = (out.view(T, H, hd).transpose(0, 1).float() - ref[0].float()).abs().max().item()
            print(f"  {cfg}: {timed(lambda: tk.flash_prompt_attention(q, k, v, pos, slots, KV, cfg)):.3f} ms  max err {err:.3g}")
        except Exception as e:
            print(f"  {cfg}: failed {str(e).splitlines()[0][:120]}")
