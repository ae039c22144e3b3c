"""Peak resident memory of `floe run` against llama.cpp on the same GGUF file (issue 15's goal: floe's
peak RSS ≤ llama.cpp's + the torch runtime), each in a fresh process, read as it ends (VmHWM).

    python bench/peak_rss.py [--model FILE.gguf] [--threads 2] [--max-tokens 8] [--context 256]

Five fresh processes, one after another, each its peak resident memory:
- floe's runtime: what `floe run` holds before any weight (torch, floe's modules, the native kernels);
- `floe run PROMPT --model FILE --max-tokens N --threads T --context C --json`, as a user runs it;
- llama.cpp's runtime: `import llama_cpp` (llama-cpp-python, the `bench` extra; without it, no peer);
- llama.cpp: `Llama(FILE, n_ctx=C)`, the prompt tokenized, N tokens greedy (create_completion);
- the file's size beside them.
The goal's right side is llama.cpp's peak + (floe's runtime - llama.cpp's runtime): the same model
work, floe paying the torch runtime on top. Writes bench/results/peak_rss_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from smoke import results, shrink  # noqa: E402

PROMPT = "What is the capital of France?"
REPORT = ("import re as _re, sys as _sys\n"
          "_s = open('/proc/self/status').read()\n"
          "print('VMHWM', int(_re.search(r'VmHWM:\\s+(\\d+)', _s).group(1)) * 1024, file=_sys.stderr)\n")
# What `floe run` holds before any weight (tests/test_memory_bounds.py's RUNTIME).
FLOE_RUNTIME = ("import torch, floe.cli, floe.actor, floe.engine, floe.model, floe.engine.cpu_decode\n"
                "from floe.engine import qgemv\nqgemv.load('auto')\n")
FLOE_RUN = "import sys\nfrom floe.cli import main\nrc = main(sys.argv[1:])\nassert rc == 0, rc\n"
LLAMA_RUNTIME = "import llama_cpp\n"
LLAMA_RUN = """import sys, llama_cpp
path, ctx, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(path, n_ctx=ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
out = llm.create_completion(sys.argv[5], max_tokens=n, temperature=0.0)
print(out["choices"][0]["text"])
"""


def peak(code: str, *argv: str) -> tuple[int, str]:
    """Run `code` in a fresh interpreter; its peak resident memory (bytes) and stdout."""
    proc = subprocess.run([sys.executable, "-c", code + "\n" + REPORT, *argv], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"a measured process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stderr.splitlines() if x.startswith("VMHWM"))
    return int(line.split()[1]), proc.stdout


def has_llama_cpp() -> bool:
    return subprocess.run([sys.executable, "-c", LLAMA_RUNTIME], capture_output=True).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    args = shrink(ap.parse_args(), max_tokens=2)
    if args.model is None:
        from floe.model.default import default_model_path

        args.model = str(default_model_path())
    model = Path(args.model)
    mb = lambda b: f"{b / 1e6:,.0f} MB"  # noqa: E731
    r: dict = {"model": str(model), "file_bytes": model.stat().st_size, "threads": args.threads,
               "max_tokens": args.max_tokens, "context": args.context,
               "cpu": re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1)}
    r["floe_runtime"], _ = peak(FLOE_RUNTIME)
    r["floe_run"], out = peak(FLOE_RUN, "run", PROMPT, "--model", str(model), "--max-tokens",
                              str(args.max_tokens), "--threads", str(args.threads), "--context",
                              str(args.context), "--json")
    r["floe_text"] = json.loads(out)["text"]
    print(f"file {mb(r['file_bytes'])}; floe's runtime {mb(r['floe_runtime'])}; "
          f"`floe run` {mb(r['floe_run'])}")
    if has_llama_cpp():
        r["llama_cpp_runtime"], _ = peak(LLAMA_RUNTIME)
        r["llama_cpp"], r["llama_cpp_text"] = peak(LLAMA_RUN, str(model), str(args.context),
                                                   str(args.threads), str(args.max_tokens), PROMPT)
        r["goal_bytes"] = r["llama_cpp"] + r["floe_runtime"] - r["llama_cpp_runtime"]
        r["goal_met"] = r["floe_run"] <= r["goal_bytes"]
        print(f"llama.cpp's runtime {mb(r['llama_cpp_runtime'])}; llama.cpp {mb(r['llama_cpp'])}; goal: floe "
              f"≤ llama.cpp + (floe's runtime - llama.cpp's) = {mb(r['goal_bytes'])}: "
              f"{'met' if r['goal_met'] else 'NOT met'} (floe - goal: {mb(r['floe_run'] - r['goal_bytes'])})")
    else:
        print("llama-cpp-python is not installed (pip install -e '.[bench]'): no peer")
    path = results(Path(__file__).parent / "results" / f"peak_rss_{model.stem}.json")
    path.write_text(json.dumps(r, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
