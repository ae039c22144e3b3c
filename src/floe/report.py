"""How `floe profile` shows what it measured: a terminal table, a roofline PNG, an HTML report."""

from __future__ import annotations

import base64
import io

from rich.console import Console
from rich.table import Table


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def _weights(w: dict) -> str:
    """The weights' kind, and the CPU kernel that runs native ones (e.g. 'native (avx2 kernel)')."""
    return f"{w['kind']} ({w['kernel']} kernel)" if w.get("kernel") else w["kind"]


def print_report(r: dict, console: Console) -> None:
    run, roof, d = r["run"], r["roofline"], r["dispatches"]
    console.print(f"[bold]{r['model']['name']}[/bold] ({r['model']['file_type']}) on {r['device']}, "
                  f"{r['dtype']} engine, {_weights(r['weights'])} weights · "
                  f"prompt {run['prompt_tokens']} tokens, "
                  f"{run['generated_tokens']} generated · TTFT {run['ttft_ms']:.1f} ms · actor decode "
                  f"{run['decode_tok_s']:.1f} tok/s")
    t = Table(title="Boundaries: where data crossed, copied or shared")
    for col, just in (("boundary", "left"), ("calls", "right"), ("copies", "right"), ("bytes", "right"),
                      ("µs", "right")):
        t.add_column(col, justify=just)
    for b in r["boundaries"]:
        shared = " (shared)" if b["copies"] == 0 else ""
        t.add_row(b["name"], str(b["calls"]), str(b["copies"]), _bytes(b["bytes"]) + shared,
                  f"{b['seconds'] * 1e6:.0f}")
    console.print(t)
    lo = r["ledger_overhead"]
    console.print(f"[dim]ledger: {lo['records']} records × {lo['per_record_us']:.2f} µs = "
                  f"{lo['total_us']:.0f} µs ({lo['pct_of_turn']:.3f} % of the turn)[/dim]")
    t = Table(title=f"Dispatches ({d['counted'].replace('_', ' ')})")
    t.add_column("step")
    t.add_column("count", justify="right")
    t.add_row(f"prefill ({roof['prefill_tokens']} tokens)", f"{d['prefill']:.0f}")
    t.add_row("decode, per token", f"{d['decode_per_token']:.0f}")
    console.print(t)
    t = Table(title="Roofline (ceilings measured in this run)")
    for col in ("", "achieved", "ceiling", "% of ceiling"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row(f"decode ({_bytes(roof['decode_bytes_per_token'])}/token)",
              f"{roof['decode_tok_s']:.1f} tok/s = {roof['decode_achieved_gb_s']:.1f} GB/s",
              f"{roof['decode_ceiling_tok_s']:.1f} tok/s = {roof['bandwidth_gb_s']:.1f} GB/s",
              f"{roof['decode_pct_of_ceiling']:.1f} %")
    t.add_row(f"prefill ({roof['prefill_flops'] / 1e9:.1f} GFLOP)",
              f"{roof['prefill_achieved_tflop_s']:.3f} TFLOP/s",
              f"{roof['matmul_tflop_s']:.3f} TFLOP/s ({r['matmul_dtype']} matmul)",
              f"{roof['prefill_pct_of_ceiling']:.1f} %")
    console.print(t)
    if "ablation" in r:
        t = Table(title=f"Fusion ablation: {r['ablation_what']}")
        for col in ("fusion", "decode dispatches/token", "prefill dispatches", "TTFT ms (actor)",
                    "prefill ms", "decode tok/s"):
            t.add_column(col, justify="right")
        for a in r["ablation"]:
            t.add_row(a["fusion"], f"{a['decode_dispatches_per_token']:.0f}",
                      f"{a['prefill_dispatches']:.0f}", f"{a['ttft_ms']:.1f}", f"{a['prefill_ms']:.1f}",
                      f"{a['decode_tok_s']:.1f}")
        console.print(t)


def roofline_png(r: dict) -> bytes:
    """A log-log roofline: the bandwidth slope and the matmul-rate roof measured in this run, with
    this run's decode step and prefill placed by arithmetic intensity (FLOP per byte moved)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roof = r["roofline"]
    bw, peak = roof["bandwidth_gb_s"] * 1e9, roof["matmul_tflop_s"] * 1e12
    decode_flop = roof["decode_flops_per_token"]
    points = {
        "decode step": (decode_flop / roof["decode_bytes_per_token"], decode_flop * roof["decode_tok_s"]),
        f"prefill ({roof['prefill_tokens']} tokens)": (
            roof["prefill_flops"] / roof["prefill_weight_bytes"], roof["prefill_achieved_tflop_s"] * 1e12),
    }
    lo = min(x for x, _ in points.values()) / 4
    hi = max(max(x for x, _ in points.values()) * 4, peak / bw * 4)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot(xs, [min(bw * x, peak) for x in xs], color="black", lw=2, label="measured ceiling")
    ax.axvline(peak / bw, color="grey", ls=":", lw=1)
    for (name, (x, y)), color in zip(points.items(), ("tab:blue", "tab:orange"), strict=False):
        ax.scatter([x], [y], s=60, color=color, zorder=3, label=f"{name}: {y / 1e9:.1f} GFLOP/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per weight byte read)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"{r['model']['name']} on {r['device']}: {roof['bandwidth_gb_s']:.0f} GB/s, "
                 f"{roof['matmul_tflop_s']:.2f} TFLOP/s ({r['matmul_dtype']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def html_report(r: dict, png: bytes | None) -> str:
    """One self-contained HTML page (the plot embedded as a data URI, no external files)."""
    import importlib.resources

    import jinja2

    template = importlib.resources.files("floe.templates").joinpath("profile.html.j2").read_text()
    env = jinja2.Environment(autoescape=True)
    return env.from_string(template).render(r=r, png=base64.b64encode(png).decode() if png else None)
