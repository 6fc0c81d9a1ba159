"""AttentionOptions: a layer's sliding window, attention sinks and logit soft-cap.

One value per attention layer and call (``AttentionBackend.forward``'s ``window`` / ``sinks`` /
``softcap`` keywords, validated here). Semantics as transformers implements them, for a query at
absolute position p and a key at position j <= p:

* ``window`` W: the key is visible iff ``p - j < W`` (the last W keys including the query's own;
  Mistral's, Gemma's and gpt-oss's ``sliding_window``). None: every earlier key.
* ``sinks`` [Hq] float: query head h's softmax gets one more logit ``sinks[h]`` in its
  denominator, with no value (gpt-oss): ``out = sum_j e^{s_j} v_j / (e^{sink} + sum_j e^{s_j})``.
* ``softcap`` c: each scaled score s becomes ``c * tanh(s / c)`` before masking (Gemma 2).

``keys_from(p)`` is the first key a query at p reads: kernels start their key loop there rather
than reading and masking the keys before it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionOptions:
    window: int | None = None
    sinks: torch.Tensor | None = None
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        """No option set: causal attention over every earlier key."""
        return self.window is None and self.sinks is None and self.softcap is None

    def names(self) -> set[str]:
        """The options set, by their keyword names."""
        return {n for n, v in (("window", self.window), ("sinks", self.sinks),
                               ("softcap", self.softcap)) if v is not None}

    def keys_from(self, pos: int) -> int:
        """The first key position a query at ``pos`` attends to."""
        return 0 if self.window is None else max(0, pos - self.window + 1)

    def sinks_f32(self) -> torch.Tensor | None:
        """The sinks as contiguous float32 (what the kernels read), or None."""
        if self.sinks is None:
            return None
        return self.sinks.detach().to(torch.float32).contiguous()


PLAIN = AttentionOptions()


def attention_options(window, sinks, softcap, q: torch.Tensor) -> AttentionOptions:
    """Validate ``forward``'s keywords against q [T, Hq, D]; raises ValueError naming the field."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window: expected an int >= 1 or None, got {window!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise ValueError(f"sinks: expected a torch.Tensor or None, got {type(sinks).__name__}")
        if not sinks.dtype.is_floating_point or tuple(sinks.shape) != (q.shape[1],):
            raise ValueError(f"sinks: expected a floating tensor of shape [{q.shape[1]}] (one logit "
                             f"per query head), got {sinks.dtype} {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"sinks: on {sinks.device} but q is on {q.device}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not softcap > 0):
        raise ValueError(f"softcap: expected a positive float or None, got {softcap!r}")
    if window is None and sinks is None and softcap is None:
        return PLAIN
    return AttentionOptions(window, sinks, None if softcap is None else float(softcap))
