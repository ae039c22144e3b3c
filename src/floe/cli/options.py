"""The command line's shared option texts and argument types (sizes, durations, devices, counts)."""

from __future__ import annotations

import argparse

DEFAULT_PROMPT_HELP = "the user's message (the model's chat template wraps it)"


MODEL_HELP = ("GGUF file, Hugging Face folder, or a repo id in the local Hugging Face cache (owner/name, "
              "owner/name:Q4_0; nothing is downloaded) (default: SmolLM2-135M-Instruct)")


# --weights: (activation and KV cache dtype, Engine weights kind)
WEIGHTS = {"native": ("float32", "native"), "bf16": ("bfloat16", "dense"), "fp32": ("float32", "dense"),
           "f16": ("float32", "f16")}


def weights_for(device: str, weights: str | None) -> str:
    """--weights on `device` (cpu, cuda…, webgpu): its default where not given; a choice the device cannot
    run is an error now, before the model loads (Engine refuses it too, after)."""
    from floe.errors import FloeError

    webgpu = device == "webgpu"
    chosen = weights or ("fp32" if webgpu else "native" if device.startswith("cpu") else "bf16")
    if webgpu and chosen not in ("fp32", "f16"):
        raise FloeError(f"--weights {chosen}: --device webgpu runs fp32 or f16 weights")
    if chosen == "f16" and not webgpu:
        raise FloeError("--weights f16 is WebGPU's storage (--device webgpu); elsewhere choose fp32 or bf16")
    return chosen


THREADS_HELP = "CPU threads for the model (default: the cores idle when floe starts)"


WEIGHTS_HELP = ("native: a quantized GGUF's 4-bit/8-bit weights as the file stores them (CPU; the "
                "default there); bf16 or fp32: dequantized (bf16 is the default on cuda); f16: "
                "float16 matrices on webgpu (fp32 is its default)")


def _bytes(text: str) -> int:
    """A byte count: 1000000, 512M, 2G (binary multiples: K, M, G, T)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(text[-1:].upper(), 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 1000000, 512M, 2G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be > 0")
    return value


def _device_or_webgpu(text: str) -> str:
    """_device's, or webgpu (wgpu's WebGPU: Vulkan, Metal, D3D12)."""
    return text if text == "webgpu" else _device(text)


def _device(text: str) -> str:
    """cpu, cuda or cuda:N, checked without importing torch (a typo is a usage error at once)."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not (kind == "cuda" and index.isdigit())):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: choose cpu, cuda or cuda:N")
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
