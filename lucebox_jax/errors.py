"""Typed exceptions of the public API. The CLI turns each into a one-line message and a non-zero exit."""


class LuceboxError(Exception):
    """Base class of every error this package raises on bad input."""


class ModelNotFoundError(LuceboxError, FileNotFoundError):
    """The model file or checkpoint folder does not exist or cannot be read."""


class UnsupportedModelError(LuceboxError, ValueError):
    """The model's architecture or a tensor type is not supported."""


class CheckpointError(LuceboxError):
    """A converted checkpoint is stale, corrupt or of another format version."""


class PromptTooLongError(LuceboxError, ValueError):
    """A prompt does not fit in the model's context."""


class EmptyPromptError(LuceboxError, ValueError):
    """A prompt with no tokens."""


class InvalidRequestError(LuceboxError, ValueError):
    """A request field of the wrong type or value (a prompt token id that is a float, text that is not UTF-8...)."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter outside its valid range or of the wrong type."""


class ResourceLimitError(LuceboxError):
    """A request needs more of a resource (device memory) than there is; the message names the limit."""


class ParallelismError(LuceboxError, ValueError):
    """A tensor-parallel size the devices or the model cannot take (more devices than exist, a size that does not
    divide the vocabulary, the FFN or a quantization group)."""


class UnknownKernelError(LuceboxError, KeyError):
    """A kernel or op name that is not registered."""

    def __str__(self):  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
