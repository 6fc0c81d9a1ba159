"""Tensor-parallel decoder models (Qwen3, Llama, Qwen2, their mixtures of experts, Mistral, Phi-3,
SmolLM3, Gemma 2 and Gemma 3) and their safetensors loader.

Public entry points: :func:`load_model` builds this rank's shard from a checkpoint directory;
:class:`TPContext` names the rank and process group. See decoder.py for the model API the runner
uses.
"""
from tpserve.models.decoder import CausalLM
from tpserve.models.errors import CheckpointError, UnsupportedModelError
from tpserve.models.loader import load_model
from tpserve.models.parallel import TPContext
from tpserve.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec, model_spec

__all__ = ["CausalLM", "CheckpointError", "UnsupportedModelError", "load_model", "TPContext",
           "SUPPORTED_ARCHITECTURES", "ModelSpec", "model_spec"]
