"""The disk tier's format: one directory per KV layout, a manifest, one file per block and rank.

    <kv_offload_dir>/<fingerprint>/manifest.json      the layout the files were written for
    <kv_offload_dir>/<fingerprint>/rank<r>/<hash>.kv  block <hash> (16 hex digits), rank r's shard

The fingerprint hashes the layout (model directory, its config.json, its weight files' names and
sizes, KV dtype, block size, tensor-parallel degree, layers, KV heads per rank, head size and the
format version): a daemon started with another model, dtype, block size or TP degree looks in
another directory, and a directory whose manifest does not match its layout is ignored.

A block file is a fixed header, the block's token ids (int64) and the payload (the rank's K and
V of every layer, ``[layers, 2, block_size, kv_heads, head_dim]`` in the KV dtype):

    magic "TPKV" | version u32 | fingerprint 16 B | hash u64 | parent hash u64 (2^64-1: none)
    | rank u32 | num tokens u32 | payload bytes u64 | xxh64 of tokens and payload u64

Writes go to a temporary name in the same directory and are renamed into place (a reader sees
a whole file or none). A read checks every header field against what the caller expects and
the checksum against the contents: any mismatch (corrupt, truncated, foreign) is a miss.
Nothing here imports torch: the scheduler side scans directories, the worker side reads and
writes payload bytes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
from array import array
from pathlib import Path

import xxhash

log = logging.getLogger("tpserve.kv_tiers")

FORMAT_VERSION = 1
MAGIC = b"TPKV"
HEADER = struct.Struct("<4sI16sQQIIQQ")
NO_PARENT = (1 << 64) - 1
SUFFIX = ".kv"


def fingerprint(layout: dict) -> str:
    """32 hex digits naming ``layout`` (a JSON-able dict; see the module docstring)."""
    text = json.dumps({**layout, "format_version": FORMAT_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def model_identity(model_path: Path) -> dict:
    """What names a model's weights: its directory, config.json and weight files' sizes."""
    path = Path(model_path).resolve()
    cfg = path / "config.json"
    weights = sorted((p.name, p.stat().st_size) for p in path.glob("*.safetensors")) if path.is_dir() else []
    return {"model": str(path), "config": cfg.read_text() if cfg.is_file() else "", "weights": weights}


def layout_dir(root: str | os.PathLike, fp: str) -> Path:
    return Path(root) / fp


def rank_dir(root: str | os.PathLike, fp: str, rank: int) -> Path:
    return Path(root) / fp / f"rank{rank}"


def block_name(h: int) -> str:
    return f"{h:016x}{SUFFIX}"


def file_size(num_tokens: int, payload_bytes: int) -> int:
    """Bytes of one block file."""
    return HEADER.size + 8 * num_tokens + payload_bytes


def check_manifest(root, fp: str, layout: dict) -> bool:
    """Make ``<root>/<fp>`` hold the manifest of ``layout``. True when the directory's files
    may be used (its manifest matches, or there was none); False when it was written for
    another layout (its files are then ignored, and the manifest is rewritten for this one)."""
    d = layout_dir(root, fp)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "manifest.json"
    want = {**json.loads(json.dumps(layout, default=str)), "format_version": FORMAT_VERSION}
    ok = True
    if path.is_file():
        try:
            ok = json.loads(path.read_text()) == want
        except (OSError, ValueError):
            ok = False
        if ok:
            return True
        log.warning("KV disk tier: %s was written for another model or layout; its files are ignored", d)
    write_atomic(path, json.dumps(want, sort_keys=True, indent=1).encode())
    return ok


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _checksum(tokens: bytes, payload) -> int:
    h = xxhash.xxh64()
    h.update(tokens)
    h.update(payload)
    return h.intdigest()


def encode_block(fp: str, h: int, parent: int, rank: int, tokens: list[int], payload) -> list:
    """The pieces of one block file (header, tokens, payload), to be written in order."""
    tok = array("q", tokens).tobytes()
    header = HEADER.pack(MAGIC, FORMAT_VERSION, bytes.fromhex(fp), h, NO_PARENT if parent == -1 else parent,
                         rank, len(tokens), len(payload), _checksum(tok, payload))
    return [header, tok, payload]


def decode_block(data: bytes, fp: str, h: int, parent: int, rank: int, tokens: list[int] | None,
                 payload_bytes: int) -> tuple[memoryview | None, str]:
    """The payload of a block file's contents ``data``, or (None, why) when any field differs
    from what is expected (``tokens`` None: any token ids) or the checksum fails."""
    if len(data) < HEADER.size:
        return None, "truncated"
    magic, version, got_fp, got_h, got_parent, got_rank, n, plen, checksum = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        return None, "not a block file"
    if got_fp != bytes.fromhex(fp):
        return None, "written for another model or layout"
    if got_h != h or got_rank != rank or got_parent != (NO_PARENT if parent == -1 else parent):
        return None, "another block"
    if plen != payload_bytes or len(data) != HEADER.size + 8 * n + plen:
        return None, "truncated" if len(data) < HEADER.size + 8 * n + plen else "wrong size"
    mv = memoryview(data)
    tok = mv[HEADER.size:HEADER.size + 8 * n]
    payload = mv[HEADER.size + 8 * n:]
    if tokens is not None and array("q", tok.tobytes()).tolist() != list(tokens):
        return None, "other token ids"
    if _checksum(tok, payload) != checksum:
        return None, "checksum mismatch"
    return payload, ""


def scan(directory: Path, size: int) -> tuple[list[int], list[int]]:
    """Block files in ``directory``: (hashes of files of ``size`` bytes, least recently written
    first; hashes of files of another size). Temporary files are skipped."""
    good, bad = [], []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return good, bad
    found = []
    for e in entries:
        name = e.name
        if not name.endswith(SUFFIX) or name.startswith(".") or len(name) != 16 + len(SUFFIX):
            continue
        try:
            h = int(name[:16], 16)
            st = e.stat()
        except (ValueError, OSError):
            continue
        (found.append((st.st_mtime_ns, h)) if st.st_size == size else bad.append(h))
    good = [h for _, h in sorted(found)]
    return good, bad
