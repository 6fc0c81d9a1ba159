"""Copying checkpoint tensors into (sharded) parameters.

Every parallel layer attaches a ``weight_loader(param, loaded_weight[, shard_id])`` to its
parameters; the loader calls it with the *full* checkpoint tensor and the layer narrows it to
this rank's shard. Parameters without one (norms, replicated weights) use
:func:`default_weight_loader`. Shape mismatches raise :class:`CheckpointError`, because they mean
the checkpoint does not fit config.json.
"""
from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence

import torch

from tpserve.models.errors import CheckpointError


def check_shape(loaded: torch.Tensor, expected: Sequence[int], what: str) -> None:
    """Raise CheckpointError unless the full checkpoint tensor has shape ``expected``."""
    if tuple(loaded.shape) != tuple(expected):
        raise CheckpointError(
            f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, the model config "
            f"needs {tuple(expected)}")


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a replicated (unsharded) tensor; converts dtype and device."""
    check_shape(loaded_weight, param.shape, "replicated weight")
    with torch.no_grad():
        param.copy_(loaded_weight)


def new_param(*shape: int) -> torch.nn.Parameter:
    """An uninitialised, frozen parameter in the current default dtype and device.

    The loader fills every parameter from the checkpoint, so initialisation would be wasted work.
    """
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


class _LayerLoader:
    """A layer's bound ``weight_loader`` kept on one of its parameters through a weak reference
    to the layer: the bound method itself would close a cycle (layer -> parameter -> method ->
    layer), and a dropped model's weights would stay allocated until the cycle collector ran."""

    __slots__ = ("_method",)

    def __init__(self, method):
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args):
        return self._method()(*args)


def attach_loader(param: torch.nn.Parameter, loader) -> torch.nn.Parameter:
    param.weight_loader = _LayerLoader(loader) if inspect.ismethod(loader) else loader
    return param
