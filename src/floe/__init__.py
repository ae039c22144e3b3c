"""floe: stateful WebAssembly actors that drive LLM inference with zero-copy memory."""

__version__ = "0.1.0"
