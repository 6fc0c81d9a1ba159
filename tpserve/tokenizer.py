"""Loading a model directory's tokenizer without importing torch.

The engine (rank 0) and the HTTP front both tokenize, and both must produce the same ids for
the same text, so both load the tokenizer here. The front is a process of its own that never
touches a tensor: importing torch would cost it seconds of start-up and hundreds of MiB.

``transformers.AutoTokenizer`` cannot be used for that: importing it imports the model
configuration machinery, which imports torch whenever torch is installed. The tokenizer classes
themselves do not, so this module picks the class the way the checkpoint declares it
(``tokenizer_class`` in tokenizer_config.json, looked up among transformers' public names,
which imports only that tokenizer's module) and falls back to the generic ``tokenizer.json``
backend (``PreTrainedTokenizerFast``) when the declared class is missing or unknown, or when
it is ``LlamaTokenizer`` over a byte-level ``tokenizer.json`` (Llama 3 style checkpoints that
declare the SentencePiece-era class: AutoTokenizer loads those generically too).

Where AutoTokenizer deviates from the declared class for a model type (it overrides some
checkpoints whose declared class is known to be wrong), the class loaded here can differ from
AutoTokenizer's; for the architectures tpserve serves the ids are the same (tested against
AutoTokenizer on the bundled model and the test models).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("tpserve.tokenizer")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path) -> bool:
    """Whether the model directory ships tokenizer files."""
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(path):
    """The model directory's tokenizer, or None when it ships none (token-id prompts only)."""
    if not has_tokenizer(path):
        log.warning("%s has no tokenizer: prompts must be token ids and outputs carry no text", path)
        return None
    return tokenizer_class(path).from_pretrained(str(path))


def tokenizer_class(path) -> type:
    """The transformers tokenizer class for the model directory ``path`` (imports no torch)."""
    import transformers

    declared = _declared_class(Path(path))
    if declared:
        cls = getattr(transformers, declared, None)
        if declared.removesuffix("Fast") == "LlamaTokenizer" and _is_byte_level(Path(path)):
            return transformers.PreTrainedTokenizerFast
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
            return cls
        log.warning("%s declares tokenizer class %r, which transformers does not provide; "
                    "loading tokenizer.json generically", path, declared)
    return transformers.PreTrainedTokenizerFast


def _declared_class(path: Path) -> str | None:
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) and name.isidentifier() else None


def _is_byte_level(path: Path) -> bool:
    """Whether tokenizer.json pre-tokenizes or decodes byte-level (the GPT-2 / Llama 3 scheme)."""
    try:
        spec = json.loads((path / "tokenizer.json").read_text())
    except (FileNotFoundError, ValueError):
        return False
    return '"ByteLevel"' in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
