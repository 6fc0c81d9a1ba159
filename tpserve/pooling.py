"""Embeddings and scores (``--runner pooling``): the request's PoolingParams, the engine's
PoolerConfig, and the numpy end of a pooled vector. No torch: the scheduler side reads it.

A pooling engine runs each prompt once, as a prefill that samples nothing, and reports one
vector per prompt instead of tokens (vLLM's pooling runner):

- **embed**: the final hidden states pooled by the config's ``pooling_type`` -- ``LAST`` (the
  last prompt token's, the default for decoders such as Qwen3-Embedding), ``MEAN`` (the mean
  over every prompt token) or ``CLS`` (the first token's) --, truncated to ``dimensions``
  (Matryoshka representations: the leading components) and then L2-normalised unless
  ``normalize`` is false.
- **classify**: one score per prompt from the last token's hidden state through a score head
  of one label (several labels: their softmax): ``score.weight`` of a
  ``*ForSequenceClassification`` checkpoint, or, for a causal LM read as a yes/no reranker (Qwen3-Reranker), the difference of the LM head's rows
  of the two score tokens, configured as vLLM configures them (``classifier_from_token``, e.g.
  ``["no", "yes"]``, or ``score_token_ids``), so that the score is
  ``sigmoid(logit[yes] - logit[no])`` without computing the LM head. A causal LM without them
  has no score head (an embedding model: rerank and score compare embeddings instead).
  ``use_activation`` false reports the raw logit instead of its sigmoid.

``PoolerConfig`` takes vLLM's ``--pooler-config`` keys (``pooling_type``, ``normalize``,
``dimensions``, ``use_activation``) plus ``classifier_from_token`` (vLLM's hf-override key of
the same meaning) or ``score_token_ids`` (the two token ids directly); anything else is
refused naming the key.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from tpserve.errors import ConfigError, InvalidFieldError

POOLING_TYPES = ("LAST", "MEAN", "CLS")
TASKS = ("embed", "classify")
RUNNERS = ("generate", "pooling")
#: The most prompts one embed / classify call may carry (OpenAI's limit for embeddings).
MAX_POOLING_INPUTS = 2048
#: The most dimensions a request may ask for (above any model's hidden size).
MAX_DIMENSIONS = 1 << 16


def _bool(name: str, value: Any, error=InvalidFieldError) -> bool:
    if not isinstance(value, bool):
        raise error(name, f"must be true or false, got {value!r}")
    return value


def _dims(name: str, value: Any, error=InvalidFieldError) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIMENSIONS:
        raise error(name, f"must be an integer in [1, {MAX_DIMENSIONS}], got {value!r}")
    return value


@dataclass(frozen=True)
class PoolingParams:
    """What one embed / classify request asks for (vLLM's names).

    ``task``: "embed" or "classify". ``dimensions``: keep the first ``dimensions`` components
    of an embedding (then normalised); None keeps them all; more than the model has is refused
    by the engine. ``normalize``: L2-normalise an embedding (None: the pooler config's default,
    true). Classify takes neither."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self):
        if self.task not in TASKS:
            raise InvalidFieldError("task", f"must be one of {', '.join(TASKS)}, got {self.task!r}")
        _dims("dimensions", self.dimensions)
        if self.normalize is not None:
            _bool("normalize", self.normalize)
        if self.task == "classify" and self.dimensions is not None:
            raise InvalidFieldError("dimensions", "applies to embeddings, not to classify")


@dataclass(frozen=True)
class PoolerConfig:
    """The engine's pooler (``--pooler-config``, module docstring). ``pooling_type`` None is
    LAST, the decoders' default."""

    pooling_type: str | None = None
    normalize: bool = True
    dimensions: int | None = None
    use_activation: bool = True
    classifier_from_token: tuple[str, str] | None = None
    score_token_ids: tuple[int, int] | None = None

    @property
    def pooling(self) -> str:
        return self.pooling_type or "LAST"

    @classmethod
    def from_value(cls, value) -> "PoolerConfig":
        """A PoolerConfig from a dict, a JSON object's text, or one (ConfigError naming the key)."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError("pooler_config", f"is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("pooler_config", f"must be a JSON object, got {type(value).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        for key in value:
            if key not in known:
                raise ConfigError(f"pooler_config.{key}",
                                  f"is not a pooler option; known: {', '.join(sorted(known))}")
        v = dict(value)
        name = "pooler_config."
        ptype = v.get("pooling_type")
        if ptype is not None:
            if not isinstance(ptype, str) or ptype.upper() not in POOLING_TYPES:
                raise ConfigError(name + "pooling_type",
                                  f"must be one of {', '.join(POOLING_TYPES)}, got {ptype!r}")
            v["pooling_type"] = ptype.upper()
        for key in ("normalize", "use_activation"):
            if key in v:
                _bool(name + key, v[key], ConfigError)
        _dims(name + "dimensions", v.get("dimensions"), ConfigError)
        toks = v.get("classifier_from_token")
        if toks is not None:
            if (not isinstance(toks, (list, tuple)) or len(toks) != 2
                    or not all(isinstance(t, str) and t for t in toks)):
                raise ConfigError(name + "classifier_from_token",
                                  f"must be two token strings [no, yes], got {toks!r}")
            v["classifier_from_token"] = tuple(toks)
        ids = v.get("score_token_ids")
        if ids is not None:
            if (not isinstance(ids, (list, tuple)) or len(ids) != 2
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
                raise ConfigError(name + "score_token_ids", f"must be two token ids [no, yes], got {ids!r}")
            v["score_token_ids"] = tuple(ids)
        return cls(**v)

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("classifier_from_token", "score_token_ids"):
            if d[key] is not None:
                d[key] = list(d[key])
        return d


def is_sequence_classifier(hf_config: dict) -> bool:
    """A ``*ForSequenceClassification`` checkpoint (its own score head, ``score.weight``)."""
    return any(str(a).endswith("ForSequenceClassification") for a in hf_config.get("architectures") or [])


def resolve_score_tokens(config: PoolerConfig, tokenizer, vocab_size: int | None) -> tuple[int, int] | None:
    """The [no, yes] token ids of a yes/no reranker's score head: ``score_token_ids``, else the
    ids of ``classifier_from_token`` in ``tokenizer``'s vocabulary. None when neither is
    configured (the model then has no score head: a causal LM is an embedding model unless told
    it is a reranker, as in vLLM); ConfigError when configured tokens are not in it."""
    ids = config.score_token_ids
    if ids is None and tokenizer is not None and config.classifier_from_token is not None:
        names = config.classifier_from_token
        found = [tokenizer.convert_tokens_to_ids(t) for t in names]
        unk = getattr(tokenizer, "unk_token_id", None)
        if all(isinstance(i, int) and i != unk for i in found):
            ids = tuple(found)
        else:
            raise ConfigError("pooler_config.classifier_from_token",
                              f"{list(names)!r} are not both tokens of this model's vocabulary")
    if ids is not None and vocab_size is not None and not all(0 <= i < vocab_size for i in ids):
        raise ConfigError("pooler_config.score_token_ids", f"{list(ids)!r} are not below vocab_size {vocab_size}")
    return None if ids is None else (int(ids[0]), int(ids[1]))


def check_runner(value: Any) -> str:
    if value not in RUNNERS:
        raise ConfigError("runner", f"must be one of {', '.join(RUNNERS)}, got {value!r}")
    return value


def wrong_runner(runner: str, what: str) -> str:
    """The message of a request the engine's ``--runner`` does not serve."""
    want = "pooling" if runner == "generate" else "generate"
    return (f"this engine runs --runner {runner}; {what} needs --runner {want} "
            f"(start the daemon, or LLM(runner=...), with --runner {want})")


def finish_embedding(vec, params: PoolingParams, config: PoolerConfig, num_tokens: int) -> list[float]:
    """A pooled vector (numpy float32; a sum over the prompt for MEAN) as the embedding the
    request asked for: averaged (MEAN), truncated to ``dimensions``, normalised."""
    import numpy as np

    v = np.asarray(vec, dtype=np.float64)
    if config.pooling == "MEAN":
        v = v / max(num_tokens, 1)
    dims = params.dimensions if params.dimensions is not None else config.dimensions
    if dims is not None:
        v = v[:dims]
    normalize = params.normalize if params.normalize is not None else config.normalize
    if normalize:
        norm = float(np.sqrt(np.dot(v, v)))
        v = v / max(norm, 1e-12)
    return v.astype(np.float32).tolist()


def finish_scores(logits, config: PoolerConfig) -> list[float]:
    """A classify result from its head's logits: one label's sigmoid, several labels' softmax
    (vLLM's activations), or the logits themselves when ``use_activation`` is false."""
    xs = [float(x) for x in logits]
    if not config.use_activation:
        return xs
    if len(xs) == 1:
        x = xs[0]
        if x >= 0:
            return [1.0 / (1.0 + math.exp(-x))]
        e = math.exp(x)
        return [e / (1.0 + e)]
    top = max(xs)
    es = [math.exp(x - top) for x in xs]
    total = sum(es)
    return [e / total for e in es]
