"""StepPlan: everything a runner needs for one engine step, as a header plus flat arrays.

The scheduler side builds a plan with numpy; every rank's runner reads it, copies the arrays
to its device once, and runs the forward. Runners never see ``Sequence`` objects, and plans
never go through pickle: they are encoded as

    +------------+------------+-----------------+-----+----------+-----+----------+
    | magic  u32 | hlen   u32 | header          | pad | array 0  | pad | array 1  | ...
    +------------+------------+-----------------+-----+----------+-----+----------+
                                                      `- array area: int32 words

The header is a fixed struct of the scalar fields and the five sizes (tokens T, sequences B,
samples S, block-table width W, logprob rows L), followed by the msgpack-encoded ``args`` when there are any. Array shapes, dtypes and order are fixed (ARRAY_FIELDS), so the
offsets follow from the sizes: the array area starts at the first 8-byte boundary after the
header, and each array starts on an 8-byte boundary within it.
``StepPlan.read_from`` returns numpy views into the buffer (no copy).

Arrays (B = num_seqs in the batch, T = num_tokens, S = sequences sampled this step):

    input_ids     int32 [T]     token ids to run
    positions     int32 [T]     their positions in their sequences
    slot_mapping  int32 [T]     KV-cache slot (block_id * block_size + offset) per token; -1 = skip
    cu_seqlens_q  int32 [B+1]   prefix sums of query lengths (new tokens per sequence)
    cu_seqlens_k  int32 [B+1]   prefix sums of key lengths (cached context + new tokens)
    context_lens  int32 [B]     key length per sequence (== diff of cu_seqlens_k)
    block_tables  int32 [B, W]  physical block ids per sequence, padded with -1; with G KV-cache
                                groups (tpserve/kv_groups.py) W = G * width, group g's table
                                in columns g * width .. (g + 1) * width - 1, -1 before a window
    logits_indices int32 [S]    rows of the hidden states whose logits are sampled (how each row
                                is sampled is rank 0's alone: SamplePlan, never published)
    logprob_rows  int32 [L]     rows of the hidden states whose full logits every rank computes
                                (prompt log-probabilities; rank 0 reads them, see SamplePlan)

Notes for runners:
    * A token row with slot -1 already has its K/V in the cache (a prompt fully covered by the
      prefix cache recomputes only its last token); such plans set ``has_context``, so attention
      reads keys through the block tables.
    * ``has_context`` is always False for decode plans (decode always reads the cache).
    * A mixed step (decode rows and prefill rows in one forward) is a prefill plan with
      context: its decode rows come first (``num_decodes`` of them), each a sequence with a
      query length of 1 whose key length is its whole length. ``is_prefill`` False therefore means pure decode, the
      only kind of plan a decode CUDA graph may run.
    * Decode plans may share read-only arrays between consecutive steps: copy, never write.
"""
from __future__ import annotations

import enum
import functools
import math
import struct
from dataclasses import dataclass, field

import msgpack
import numpy as np

MAGIC = 0x7470_5331  # "tpS1"
_PREFIX = struct.Struct("<II")
# cmd, is_prefill, has_context, max_seqlen_q, max_seqlen_k, step_id, num_decodes, T, B, S, W, L
_FIXED = struct.Struct("<B??xiiqiiiiii")
_ALIGN = 8


class Command(enum.IntEnum):
    """What a plan asks the runners to do. Only these; no dispatch by method name."""

    STEP = 0
    SHUTDOWN = 1
    PROFILE_START = 3  # 2 and 5 were commands no runner acted on; their numbers stay unused
    PROFILE_STOP = 4
    LEND_CORES = 6  # args: cores, how many of its cores a CPU rank leaves to other work (0: none)


# name -> dtype, in encoding order.
ARRAY_FIELDS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "positions": np.dtype(np.int32),
    "slot_mapping": np.dtype(np.int32),
    "cu_seqlens_q": np.dtype(np.int32),
    "cu_seqlens_k": np.dtype(np.int32),
    "context_lens": np.dtype(np.int32),
    "block_tables": np.dtype(np.int32),
    "logits_indices": np.dtype(np.int32),
    "logprob_rows": np.dtype(np.int32),
}


_NOT_INT32 = frozenset(n for n, d in ARRAY_FIELDS.items() if d != np.int32)


def _shapes(t: int, b: int, s: int, w: int, l: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of the arrays, in ARRAY_FIELDS order, from (tokens, seqs, samples, table width,
    logprob rows)."""
    return ((t,), (t,), (t,), (b + 1,), (b + 1,), (b,), (b, w), (s,), (l,))


@functools.lru_cache(maxsize=4096)
def _layout(t: int, b: int, s: int, w: int, l: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """((offset, length) in int32 words per array, total words); every array starts 8-aligned."""
    out, pos = [], 0
    for dtype, shape in zip(ARRAY_FIELDS.values(), _shapes(t, b, s, w, l)):
        n = math.prod(shape) * dtype.itemsize // 4
        out.append((pos, n))
        pos += n + (n & 1)
    return tuple(out), pos


def _area_offset(header_len: int) -> int:
    return -(-(_PREFIX.size + header_len) // _ALIGN) * _ALIGN


def _views(mv: memoryview, hlen: int, dims: tuple[int, int, int, int, int]) -> dict[str, np.ndarray]:
    """Numpy views of every array of a plan laid out in ``mv`` (one frombuffer, then slices)."""
    offsets, words = _layout(*dims)
    area = np.frombuffer(mv, dtype=np.int32, count=words, offset=_area_offset(hlen))
    out = {}
    for name, (off, n), shape in zip(ARRAY_FIELDS, offsets, _shapes(*dims)):
        arr = area[off:off + n]
        if name in _NOT_INT32:
            arr = arr.view(ARRAY_FIELDS[name])
        out[name] = arr if len(shape) == 1 else arr.reshape(shape)
    return out


# Distinct plan layouts a reused buffer remembers before its cache starts over.
_CACHE_LIMIT = 64


def _cached_views(cache: dict | None, mv: memoryview, hlen: int, dims) -> dict[str, np.ndarray]:
    if cache is None:
        return _views(mv, hlen, dims)
    key = (hlen, *dims)
    views = cache.get(key)
    if views is None:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        views = cache[key] = _views(mv, hlen, dims)
    return views


def _empty(name: str, shape=(0,)) -> np.ndarray:
    return np.zeros(shape, dtype=ARRAY_FIELDS[name])


@dataclass
class StepPlan:
    cmd: Command = Command.STEP
    is_prefill: bool = False
    # True when some prefill sequence attends to KV already in the cache (prefix hit or a
    # later chunk of a chunked prefill), so attention must read K/V through block tables.
    has_context: bool = False
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    step_id: int = 0
    # Leading sequences that are decode rows (query length 1, always sampled), as the scheduler
    # knows it: B for a decode plan. -1: not stated (runners count them from cu_seqlens_q).
    # num_decodes == T == S means every row is sampled, in order (logits_indices is arange(T)).
    num_decodes: int = -1
    # Free-form values for control commands (e.g. a profile output path); a STEP plan may carry
    # the KV tiers' commands under "kv" (tpserve/kv_tiers/connector.py), run before its forward.
    args: dict = field(default_factory=dict)
    input_ids: np.ndarray = field(default_factory=lambda: _empty("input_ids"))
    positions: np.ndarray = field(default_factory=lambda: _empty("positions"))
    slot_mapping: np.ndarray = field(default_factory=lambda: _empty("slot_mapping"))
    cu_seqlens_q: np.ndarray = field(default_factory=lambda: _empty("cu_seqlens_q", (1,)))
    cu_seqlens_k: np.ndarray = field(default_factory=lambda: _empty("cu_seqlens_k", (1,)))
    context_lens: np.ndarray = field(default_factory=lambda: _empty("context_lens"))
    block_tables: np.ndarray = field(default_factory=lambda: _empty("block_tables", (0, 0)))
    logits_indices: np.ndarray = field(default_factory=lambda: _empty("logits_indices"))
    logprob_rows: np.ndarray = field(default_factory=lambda: _empty("logprob_rows"))

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_samples(self) -> int:
        return int(self.logits_indices.shape[0])

    @classmethod
    def command(cls, cmd: Command, **args) -> "StepPlan":
        return cls(cmd=Command(cmd), args=dict(args))

    def validate(self) -> None:
        """Check shapes and dtypes agree; raises ValueError naming the field."""
        for name, dtype in ARRAY_FIELDS.items():
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype:
                raise ValueError(f"plan field {name}: expected numpy {dtype}, got "
                                 f"{getattr(arr, 'dtype', type(arr).__name__)}")
        b, t = self.num_seqs, self.num_tokens
        expect = {"positions": (t,), "slot_mapping": (t,), "cu_seqlens_q": (b + 1,),
                  "cu_seqlens_k": (b + 1,)}
        for name, shape in expect.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"plan field {name}: expected shape {shape}, got "
                                 f"{getattr(self, name).shape}")
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != b:
            raise ValueError(f"plan field block_tables: expected shape ({b}, W), got "
                             f"{self.block_tables.shape}")

    # ---- encoding ------------------------------------------------------------------------
    def _dims(self) -> tuple[int, int, int, int, int]:  # (T, B, S, W, L)
        return (self.num_tokens, self.num_seqs, self.num_samples,
                int(self.block_tables.shape[1]) if self.block_tables.ndim == 2 else 0,
                int(self.logprob_rows.shape[0]))

    def _header(self) -> bytes:
        # Fixed fields in a struct (packing them costs a fraction of msgpack's per-step price);
        # the free-form args of control commands follow as msgpack, only when present.
        extra = msgpack.packb(self.args) if self.args else b""
        return _FIXED.pack(int(self.cmd), self.is_prefill, self.has_context, self.max_seqlen_q,
                           self.max_seqlen_k, self.step_id, self.num_decodes, *self._dims()) + extra

    def nbytes(self) -> int:
        return _area_offset(len(self._header())) + 4 * _layout(*self._dims())[1]

    def write_into(self, buf, cache: dict | None = None) -> int:
        """Encode into the writable buffer ``buf``; returns the number of bytes written.

        ``cache``: a dict kept by a caller that writes into the same buffer again and again (a
        ring slot); it remembers the array views per layout so repeated plans skip building them.
        """
        header = self._header()
        dims = self._dims()
        hlen = len(header)
        total = _area_offset(hlen) + 4 * _layout(*dims)[1]
        mv = memoryview(buf).cast("B")
        if len(mv) < total:
            raise ValueError(f"buffer of {len(mv)} bytes is too small for a {total}-byte plan")
        _PREFIX.pack_into(mv, 0, MAGIC, hlen)
        mv[_PREFIX.size:_PREFIX.size + hlen] = header
        dsts = _cached_views(cache, mv, hlen, dims)
        for name, dst in dsts.items():
            arr = getattr(self, name)
            if arr.shape != dst.shape:
                raise ValueError(f"plan field {name}: expected shape {dst.shape}, got {arr.shape}")
            dst[...] = arr
        return total

    def to_bytes(self) -> bytes:
        out = bytearray(self.nbytes())
        self.write_into(out)
        return bytes(out)

    @classmethod
    def read_from(cls, buf, cache: dict | None = None) -> "StepPlan":
        """Decode a plan; arrays are read-only views into ``buf`` (copy them to keep them).

        ``cache``: as for ``write_into``, for a reader that decodes from the same buffer again
        and again; the views then stay valid only until the buffer is written again.
        """
        mv = memoryview(buf).cast("B")
        magic, hlen = _PREFIX.unpack_from(mv, 0)
        if magic != MAGIC:
            raise ValueError(f"not a StepPlan buffer (magic {magic:#x})")
        cmd, is_prefill, has_context, max_q, max_k, step_id, num_decodes, *dims = _FIXED.unpack_from(mv, _PREFIX.size)
        args = (msgpack.unpackb(mv[_PREFIX.size + _FIXED.size:_PREFIX.size + hlen], strict_map_key=False)
                if hlen > _FIXED.size else {})
        arrays = _cached_views(cache, mv, hlen, tuple(dims))
        return cls(cmd=Command(cmd), is_prefill=is_prefill, has_context=has_context, max_seqlen_q=max_q,
                   max_seqlen_k=max_k, step_id=step_id, num_decodes=num_decodes, args=args, **arrays)

    @classmethod
    def from_bytes(cls, data: bytes) -> "StepPlan":
        return cls.read_from(data)
