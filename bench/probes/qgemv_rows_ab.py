"""Two builds of one kernel variant, interleaved in one process: gemv_q over 1, 4 and 8 input rows on
SmolLM2-135M's shapes (w13 3072x576 Q4_1, w2 576x1536 Q4_1, the head 49152x576 Q8_0), checking that
both give the same bits; min of N calls each (this VM's clock moves between runs, so only a
comparison inside one process means anything).

    python bench/probes/qgemv_rows_ab.py OLD.so NEW.so [--threads 2]

The libraries are the variant builds under ~/.cache/torch_extensions/py311_cpu/floe_qdot_<variant>_*/
(a change to csrc/qdot/ builds a new folder; keep the old one's path before the change).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from floe.engine import qgemv
from floe.model.quant import QuantizedWeight

SHAPES = (("w13", (3072, 576), Q.Q4_1), ("w2", (576, 1536), Q.Q4_1), ("head", (49152, 576), Q.Q8_0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    qgemv.load("auto")  # the operator
    old, new = torch.ops.floe.qdot_load(args.old), torch.ops.floe.qdot_load(args.new)
    rng = np.random.default_rng(0)
    for name, shape, qtype in SHAPES:
        w = rng.standard_normal(shape).astype(np.float32)
        blocks = qgemv.kernel_blocks(QuantizedWeight(qtype.name, w.shape, quantize(w, qtype)))
        for m in (1, 4, 8):
            x = torch.randn(m, shape[1])
            assert torch.equal(torch.ops.floe.gemv_q(x, blocks, old), torch.ops.floe.gemv_q(x, blocks, new))
            best = {old: float("inf"), new: float("inf")}
            for _ in range(60 if name != "head" else 8):
                for kernel in (old, new):
                    t = time.perf_counter()
                    torch.ops.floe.gemv_q(x, blocks, kernel)
                    best[kernel] = min(best[kernel], time.perf_counter() - t)
            print(f"{name} m={m}: old {1e6 * best[old]:.0f} us, new {1e6 * best[new]:.0f} us, "
                  f"{best[old] / best[new]:.2f}x (same bits)")


if __name__ == "__main__":
    main()
