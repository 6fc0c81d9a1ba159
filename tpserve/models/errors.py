"""Typed errors of model building and checkpoint loading.

Both are ValueErrors: they report bad input at a boundary (a checkpoint directory, its
config.json or its tensors), never an internal bug. Messages name the offending field or
tensor, what was found and what is allowed.
"""
from __future__ import annotations


class UnsupportedModelError(ValueError):
    """config.json describes a model tpserve cannot run (architecture, activation, rope type...)."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the model: missing, unexpected or mis-shaped."""
