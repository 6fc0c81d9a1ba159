"""tpserve: a multi-process tensor-parallel serving daemon for large language models.

Importing the package loads the typed errors only; every other name here is imported on first
use, so that the command line and the client library stay light (tests/test_cli_light.py).
"""
from tpserve.errors import (AdmissionError, ConfigError, InvalidFieldError, InvalidRequestError, TpserveError,
                            WorkerDiedError)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "Client", "AsyncClient", "AdmissionError",
           "ConfigError", "InvalidRequestError", "InvalidFieldError", "TpserveError", "WorkerDiedError",
           "RequestOutput", "CompletionOutput", "Logprob", "PoolingParams"]


def __getattr__(name):
    # Heavy imports (torch, zmq, numpy) only when used: `import tpserve` stays cheap for the CLI.
    if name == "EngineConfig":
        from tpserve.config import EngineConfig
        return EngineConfig
    if name == "SamplingParams":
        from tpserve.sampling import SamplingParams
        return SamplingParams
    if name == "PoolingParams":
        from tpserve.pooling import PoolingParams
        return PoolingParams
    if name == "LLM":
        from tpserve.llm import LLM
        return LLM
    if name in ("Client", "AsyncClient"):
        from tpserve.client import client
        return getattr(client, name)
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):  # vLLM's offline output classes
        from tpserve import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'tpserve' has no attribute {name!r}")
