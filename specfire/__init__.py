"""specfire: fast single-stream inference for Qwen3.5 / Qwen3.6 dense models with lossless MTP speculation."""
from .errors import CheckpointError, SpecfireError
from .params import SamplingParams, SpecPolicy

__all__ = ["LLM", "SamplingParams", "SpecPolicy", "GenerationResult", "SpecfireError", "CheckpointError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("LLM", "GenerationResult"):
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
