"""A GGUF model as a model directory: config, generation config and tokenizer written once.

Everything in tpserve that reads a model reads a Hugging Face model directory: the engine's
tokenizer, the HTTP and gRPC fronts (tokenizer, chat template, config.json for
``/model_info``), the model loader. A ``--model file.gguf`` becomes such a directory, made
from the file's metadata the first time it is served and kept in the cache
(``$TPSERVE_CACHE_DIR/gguf/<stem>-<key>/``, default ``~/.cache/tpserve``, or
``$TPSERVE_GGUF_CACHE_DIR``): ``config.json`` and
``generation_config.json`` (``config.py``), the tokenizer (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``: transformers' GGUF tokenizer converter,
the one its ``from_pretrained(..., gguf_file=...)`` uses) and ``gguf.json``, which lists the
GGUF files whose tensors the loader reads (``tpserve/models/gguf/``). The weights stay in the
GGUF file. ``--tokenizer DIR`` puts that directory's tokenizer files there instead.

The key hashes the files' paths, sizes and modification times, the tokenizer directory and
this layout's version, so a changed file gets a new directory; every process of an engine (the
CLI, rank 0, the workers, the fronts) computes the same path. The directory is written in a
temporary directory beside it and renamed into place: processes racing to make it agree.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from tpserve.gguf_file.config import hf_config
from tpserve.gguf_file.reader import (GGUFFileError, check_types, field_value, gguf_parts, model_stem,
                                     open_reader, scan)

LAYOUT_VERSION = 1
MANIFEST = "gguf.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")


def cache_root() -> Path:
    """``$TPSERVE_GGUF_CACHE_DIR``, else ``gguf/`` in tpserve's cache (``$TPSERVE_CACHE_DIR``,
    default ``~/.cache/tpserve``)."""
    own = os.environ.get("TPSERVE_GGUF_CACHE_DIR")
    if own:
        return Path(own)
    return Path(os.environ.get("TPSERVE_CACHE_DIR") or Path.home() / ".cache" / "tpserve") / "gguf"


def model_dir(path, tokenizer: str | None = None) -> Path:
    """Where the model directory of the GGUF model ``path`` is (made or not)."""
    parts = gguf_parts(path)
    h = hashlib.sha256(f"layout {LAYOUT_VERSION}\n".encode())
    for p in parts:
        st = p.stat()
        h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    if tokenizer is not None:
        tok = Path(tokenizer).resolve()
        h.update(f"tokenizer {tok}\n".encode())
        for name in TOKENIZER_FILES:
            f = tok / name
            if f.is_file():
                h.update(f"{name}\0{f.stat().st_mtime_ns}\0{f.stat().st_size}\n".encode())
    return cache_root() / f"{model_stem(parts[0])}-{h.hexdigest()[:16]}"


def materialize(path, tokenizer: str | None = None) -> Path:
    """The model directory of the GGUF model ``path``, made if it is not there yet. Raises
    GGUFFileError naming the file (and key or tensor) for a file tpserve cannot serve."""
    target = model_dir(path, tokenizer)
    if (target / MANIFEST).is_file():
        return target
    parts = gguf_parts(path)
    tensors = []
    for p in parts:
        tensors += scan(p)
    check_types(tensors)
    reader = open_reader(parts[0])
    meta = _metadata(reader, parts[0])
    _check_split(meta, parts)
    config, generation = hf_config(meta, tensors, str(parts[0]))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as e:
        raise GGUFFileError(f"{parts[0]}: its model directory cannot be made in {target.parent} "
                            f"({e.strerror or e}); set TPSERVE_GGUF_CACHE_DIR to a writable "
                            "directory") from None
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        if tokenizer is not None:
            _copy_tokenizer(Path(tokenizer), tmp)
        elif meta.get("tokenizer.ggml.model"):
            _convert_tokenizer(parts[0], tmp)
        (tmp / MANIFEST).write_text(json.dumps({"files": [str(p.resolve()) for p in parts],
                                                "layout": LAYOUT_VERSION}, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:  # another process made it first
            if not (target / MANIFEST).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_files(directory) -> list[Path] | None:
    """The GGUF files of a model directory made by :func:`materialize` (None for any other)."""
    manifest = Path(directory) / MANIFEST
    if not manifest.is_file():
        return None
    return [Path(f) for f in json.loads(manifest.read_text())["files"]]


def _metadata(reader, where: Path) -> dict:
    """The metadata keys as plain values; the tokenizer's big arrays only by their length."""
    meta = {}
    for key in reader.fields:
        if key.startswith("GGUF."):
            continue
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores"):
            meta[f"{key}.count"] = len(reader.fields[key].data)
            continue
        try:
            meta[key] = field_value(reader, key)
        except GGUFFileError as e:
            raise GGUFFileError(f"{where}: {e}") from None
    return meta


def _check_split(meta: dict, parts: list[Path]) -> None:
    count = meta.get("split.count")
    if count is not None and count != len(parts):
        raise GGUFFileError(f"{parts[0]}: metadata key 'split.count' says {count} files, "
                            f"found {len(parts)}")


def _copy_tokenizer(source: Path, dest: Path) -> None:
    found = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if not found:
        raise GGUFFileError(f"--tokenizer {source}: no tokenizer files there "
                            f"(expected one of {', '.join(TOKENIZER_FILES[:4])})")
    for name in found:
        shutil.copyfile(source / name, dest / name)


def _convert_tokenizer(gguf_path: Path, dest: Path) -> None:
    """The file's tokenizer (vocabulary, merges or scores, special tokens, chat template) as
    transformers' fast-tokenizer files, through transformers' own GGUF converter."""
    from transformers import PreTrainedTokenizerFast

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # the converter raises many kinds; any is this file's tokenizer at fault
        raise GGUFFileError(f"{gguf_path}: its tokenizer metadata cannot be converted: "
                            f"{type(e).__name__}: {e}") from None
    tok.save_pretrained(str(dest))
