"""User-facing errors: one clear line naming what is wrong; the CLI prints them without a traceback."""


class SpecfireError(Exception):
    """Base class for errors caused by the user's input (a path, a checkpoint, a parameter)."""


class CheckpointError(SpecfireError):
    """The checkpoint directory, its config or its tensors are missing, malformed or unusable."""


class ConfigError(CheckpointError):
    """config.json is missing a field, has a wrong value, or names an unsupported model."""


class MeshError(SpecfireError):
    """A tensor-parallel rank died, hung past the timeout, or failed to start; the mesh is closed."""


class PromptError(SpecfireError, ValueError):
    """A prompt the engine cannot take (empty, not text, a token outside the vocabulary, too long);
    `too_long` marks the context-length case, which servers report with their own code."""

    def __init__(self, message: str, too_long: bool = False):
        super().__init__(message)
        self.too_long = too_long


class GrammarError(ValueError):
    """A structured-output request that cannot be compiled; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param
