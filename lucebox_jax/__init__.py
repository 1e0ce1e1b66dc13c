"""lucebox_jax: a JAX/XLA compiled LLM inference engine with int4 weights and Pallas GPU kernels.

    from lucebox_jax import LLM, SamplingParams
"""

from .errors import (CheckpointError, EmptyPromptError, InvalidRequestError, InvalidSamplingParamsError, LuceboxError,
                     ModelNotFoundError, PromptTooLongError, ResourceLimitError, UnknownKernelError,
                     UnsupportedModelError)
from .sampling import SamplingParams


def __getattr__(name):  # LLM pulls in jax and the model: import it lazily
    if name in ("LLM", "RequestOutput", "CompletionOutput", "Logprob"):
        from . import llm

        return getattr(llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "LuceboxError", "ModelNotFoundError", "UnsupportedModelError", "CheckpointError",
           "PromptTooLongError", "EmptyPromptError", "InvalidRequestError", "InvalidSamplingParamsError",
           "UnknownKernelError", "ResourceLimitError"]
