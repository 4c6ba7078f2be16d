"""pagedllm: a paged-KV-cache LLM inference and serving engine."""

from pagedllm.config import EngineArgs
from pagedllm.inputs import TextPrompt, TokensPrompt
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "EngineArgs", "TextPrompt", "TokensPrompt", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it lazily so `pagedllm --help` stays fast
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
