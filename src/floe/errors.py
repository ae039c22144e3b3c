"""The exceptions floe raises on bad input: each says what was wrong and what to do about it."""


class FloeError(Exception):
    """Base of every error floe reports to a user as one line."""


class ModelNotFound(FloeError):
    """The model path does not exist, or the default model package is not installed."""


class NotAModel(FloeError):
    """The path exists but is not a GGUF file or a Hugging Face model folder."""


class UnsupportedModel(FloeError):
    """The file is a model, but of an architecture, tokenizer or tensor type floe cannot run."""


class ContextOverflow(FloeError):
    """A prompt or generation does not fit in the model's context (KV cache)."""


class InvalidSamplingParams(FloeError, ValueError):
    """Sampling parameters out of range (temperature < 0, top_p outside (0, 1], ...)."""
