"""specfire: fast single-stream inference for Qwen3.5 / Qwen3.6 dense models with lossless MTP speculation."""
from .config import SamplingParams, SpecPolicy
from .errors import CheckpointError, SpecfireError
from .api import LLM, GenerationResult

__all__ = ["LLM", "SamplingParams", "SpecPolicy", "GenerationResult", "SpecfireError", "CheckpointError"]
__version__ = "0.1.0"
