"""tokenpath: an LLM serving system that owns the whole path of a request."""

from tokenpath.engine.outputs import CompletionOutput, RequestOutput
from tokenpath.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; keep `import tokenpath` light for the CLI and gateway.
    if name == "LLM":
        from tokenpath.engine.llm import LLM

        return LLM
    raise AttributeError(name)
