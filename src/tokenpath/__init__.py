"""tokenpath: an LLM serving system that owns the whole path of a request."""

import os

# OpenMP threads that spin while waiting steal the only cores from the HTTP event loop and from
# other processes (engine replicas, the gateway); on a shared 2-core machine a spinning 2-thread
# matmul ran 5x slower than a passive one. Must be set before torch is imported; users can override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenpath.protocol.outputs import CompletionOutput, RequestOutput
from tokenpath.protocol.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; keep `import tokenpath` light for the CLI and gateway.
    if name == "LLM":
        from tokenpath.engine.llm import LLM

        return LLM
    raise AttributeError(name)
