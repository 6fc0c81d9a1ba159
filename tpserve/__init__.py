"""tpserve: a multi-process tensor-parallel serving daemon for large language models."""
from tpserve.config import EngineConfig
from tpserve.errors import (AdmissionError, ConfigError, InvalidFieldError, InvalidRequestError, TpserveError,
                            WorkerDiedError)
from tpserve.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "Client", "AsyncClient", "AdmissionError",
           "ConfigError", "InvalidRequestError", "InvalidFieldError", "TpserveError", "WorkerDiedError"]


def __getattr__(name):
    # Heavy imports (torch, zmq) only when used: `import tpserve` stays cheap for the CLI.
    if name == "LLM":
        from tpserve.llm import LLM
        return LLM
    if name in ("Client", "AsyncClient"):
        from tpserve.client import client
        return getattr(client, name)
    raise AttributeError(f"module 'tpserve' has no attribute {name!r}")
