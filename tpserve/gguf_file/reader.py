"""Opening a GGUF file safely: a bounds-checked scan of its header, then the `gguf` package.

llama.cpp's ``gguf`` package (``GGUFReader``) parses a file it trusts: a corrupt array length
makes it loop for as long as the length says (reads past the end return empty arrays without
an error), and a truncated tensor surfaces as a numpy reshape error naming nothing. So every
file is first walked here with ``struct`` (magic, version, each key/value, each tensor's
name, shape, type and extent, all bounds-checked against the file size, array counts against
the bytes left), and only a file that passes is handed to ``GGUFReader``. Every failure is a
:class:`GGUFFileError` naming the file, and the key or tensor where it is.

Tensor types tpserve runs (``SUPPORTED_TYPES``): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K, and MXFP4 (gpt-oss's experts, dequantized at load). :func:`check_types`
refuses any other type with the tensor named.

Split files (``name-00001-of-00003.gguf``, llama.cpp's ``gguf-split``): :func:`gguf_parts`
finds every part from any one of them; each part is a GGUF file of its own (the first holds
the metadata, the others hold tensors).

No torch here: the engine configuration (``tpserve/config.py``) reads files through this
module before any process starts.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
# Q5_0 / Q5_1: the fallback llama-quantize writes for rows that are not whole K-quant blocks.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                   "MXFP4")
FLOAT_TYPES = ("F32", "F16", "BF16")
MAX_DIMS = 4
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# GGUF value types: id -> (name, struct format or None for string/array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFileError(ValueError):
    """A GGUF file tpserve cannot read; the message names the file (and the key or tensor)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file: ``shape`` in numpy order (rows first), its byte extent."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int
    file: Path


def is_gguf(path) -> bool:
    """Whether ``--model`` names a GGUF file (by its suffix)."""
    return path is not None and str(path).lower().endswith(".gguf")


def gguf_parts(path) -> list[Path]:
    """Every part of the (possibly split) GGUF model that ``path`` names, in order."""
    path = Path(path)
    m = _SPLIT.match(path.name)
    if not path.is_file():
        raise GGUFFileError(f"{path}: no such file")
    if m is None:
        return [path]
    count = int(m["count"])
    if count < 1 or not 1 <= int(m["no"]) <= count:
        raise GGUFFileError(f"{path}: split file number {m['no']} of {m['count']} is out of range")
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    absent = [p.name for p in parts if not p.is_file()]
    if absent:
        raise GGUFFileError(f"{path}: split model of {count} files is missing {', '.join(absent)}")
    return parts


def model_stem(path) -> str:
    """The name a GGUF model is served under: the file's stem, less a split suffix."""
    name = Path(path).name
    m = _SPLIT.match(name)
    return m["stem"] if m else name[:-len(".gguf")] if name.lower().endswith(".gguf") else name


def _quant_sizes() -> dict[str, tuple[int, int]]:
    import gguf
    return {t.name: gguf.GGML_QUANT_SIZES[t] for t in gguf.GGMLQuantizationType
            if t in gguf.GGML_QUANT_SIZES}


def _type_names() -> dict[int, str]:
    import gguf
    return {int(t): t.name for t in gguf.GGMLQuantizationType}


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, where: str, reason: str):
        raise GGUFFileError(f"{self.path}: {where}: {reason} (at byte {self.pos} of {self.size})")

    def take(self, fmt: str, where: str):
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            self.fail(where, "the file ends here (truncated)")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def skip(self, n: int, where: str):
        if n < 0 or self.pos + n > self.size:
            self.fail(where, f"{n} bytes run past the end of the file (truncated or corrupt)")
        self.pos += n

    def string(self, where: str) -> bytes:
        n = self.take("<Q", where)
        start = self.pos
        self.skip(n, where)
        return bytes(self.buf[start:start + n])

    def value(self, vtype: int, where: str, keep: bool):
        fmt = _SCALARS.get(vtype)
        if fmt is not None:
            return self.take(fmt, where)
        if vtype == _STRING:
            raw = self.string(where)
            return raw.decode("utf-8", "replace") if keep else None
        if vtype != _ARRAY:
            self.fail(where, f"unknown value type {vtype}")
        itype = self.take("<I", where)
        count = self.take("<Q", where)
        left = self.size - self.pos
        if itype in _SCALARS:
            width = struct.calcsize(_SCALARS[itype])
            if count * width > left:
                self.fail(where, f"an array of {count} items runs past the end of the file")
            if keep and count <= 64:
                items = struct.unpack_from(f"<{count}{_SCALARS[itype][1]}", self.buf, self.pos)
                self.pos += count * width
                return list(items)
            self.pos += count * width
            return None
        if itype == _STRING:
            if count * 8 > left:
                self.fail(where, f"an array of {count} strings runs past the end of the file")
            for _ in range(count):
                self.string(where)
            return None
        if itype == _ARRAY:
            self.fail(where, "nested arrays are not supported")
        self.fail(where, f"unknown array item type {itype}")


def scan(path) -> list[TensorEntry]:
    """Walk the whole header of one GGUF file, checking every length against the file; return
    its tensors. Raises GGUFFileError naming the file and the key or tensor at fault."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            import mmap
            try:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFFileError(f"{path}: the file is empty, not a GGUF file") from None
    except OSError as e:
        raise GGUFFileError(f"{path}: cannot be read: {e.strerror or e}") from None
    try:
        return _scan(_Cursor(buf, path))
    finally:
        buf.close()


def _scan(c: _Cursor) -> list[TensorEntry]:
    if c.size < 4 or bytes(c.buf[:4]) != GGUF_MAGIC:
        c.fail("header", f"not a GGUF file (magic {bytes(c.buf[:4])!r}, expected {GGUF_MAGIC!r})")
    c.pos = 4
    version = c.take("<I", "header")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 16) in SUPPORTED_VERSIONS:
            c.fail("header", "a big-endian GGUF file; only little-endian files are supported")
        c.fail("header", f"GGUF version {version} is not supported (supported: "
                         f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    n_tensors = c.take("<Q", "header")
    n_kv = c.take("<Q", "header")
    # The smallest key/value is 13 bytes and the smallest tensor info 24: counts beyond what
    # the file could hold are corrupt, whatever follows.
    if n_kv * 13 > c.size or n_tensors * 24 > c.size:
        c.fail("header", f"{n_kv} metadata keys and {n_tensors} tensors cannot fit in the file")
    alignment = 32
    for i in range(n_kv):
        key = c.string(f"metadata key #{i}").decode("utf-8", "replace")
        where = f"metadata key {key!r}"
        vtype = c.take("<I", where)
        value = c.value(vtype, where, keep=key == "general.alignment")
        if key == "general.alignment":
            if vtype != 4 or not value or value & (value - 1):
                c.fail(where, f"must be a power-of-two uint32, got {value!r}")
            alignment = value
    sizes, names = _quant_sizes(), _type_names()
    infos = []
    for i in range(n_tensors):
        name = c.string(f"tensor #{i}").decode("utf-8", "replace")
        where = f"tensor {name!r}"
        n_dims = c.take("<I", where)
        if not 1 <= n_dims <= MAX_DIMS:
            c.fail(where, f"{n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
        dims = [c.take("<Q", where) for _ in range(n_dims)]
        raw_type = c.take("<I", where)
        offset = c.take("<Q", where)
        type_name = names.get(raw_type)
        if type_name is None or type_name not in sizes:
            c.fail(where, f"unknown tensor type id {raw_type}")
        if any(d < 1 for d in dims):
            c.fail(where, f"shape {dims} has an empty dimension")
        block, type_size = sizes[type_name]
        if dims[0] % block:
            c.fail(where, f"its rows of {dims[0]} values are not whole {type_name} blocks of {block}")
        n = 1
        for d in dims:
            n *= d
        infos.append((name, type_name, tuple(reversed(dims)), offset, n // block * type_size))
    data_start = -(-c.pos // alignment) * alignment
    seen = set()
    out = []
    for name, type_name, shape, offset, nbytes in infos:
        if name in seen:
            c.fail(f"tensor {name!r}", "appears twice")
        seen.add(name)
        start = data_start + offset
        if offset % alignment:
            c.fail(f"tensor {name!r}", f"data offset {offset} is not aligned to {alignment}")
        if start + nbytes > c.size:
            raise GGUFFileError(
                f"{c.path}: tensor {name!r} ({type_name}, shape {list(shape)}) needs {nbytes} bytes at "
                f"{start}, but the file ends at {c.size} (truncated, or its size does not match its type)")
        out.append(TensorEntry(name, type_name, shape, start, nbytes, c.path))
    return out


def open_reader(path):
    """``gguf.GGUFReader`` over a file that :func:`scan` accepted (scan it first)."""
    import gguf
    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, TypeError, OSError) as e:
        raise GGUFFileError(f"{path}: the gguf reader refuses it: {e}") from None


def field_value(reader, key: str, default=None):
    """A metadata value as a plain Python value (strings decoded, arrays as lists)."""
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise GGUFFileError(f"metadata key {key!r} cannot be read: {e}") from None


def check_types(tensors: list[TensorEntry]) -> None:
    """Refuse a tensor whose type tpserve cannot run, naming it."""
    for t in tensors:
        if t.type_name not in SUPPORTED_TYPES:
            raise GGUFFileError(f"{t.file}: tensor {t.name!r} has type {t.type_name}, which tpserve cannot "
                                f"run; supported: {', '.join(SUPPORTED_TYPES)}")
