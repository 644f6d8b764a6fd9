from .qwen35 import Qwen35Trunk, MtpHead, SequenceState  # noqa: F401  (the package's public names)
