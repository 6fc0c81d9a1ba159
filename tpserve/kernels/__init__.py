"""Attention kernels: paged KV-cache store and attention backends (torch, Triton, flash-attn).

Callers need only these names; backend modules and Triton kernels are imported when a backend
is selected (see ``backend_factory.get_backend``), never at package import.
"""
from tpserve.kernels.attention_backend import AttentionBackend
from tpserve.kernels.backend_factory import get_backend
from tpserve.kernels.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
