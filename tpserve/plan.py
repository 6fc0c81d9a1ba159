"""StepPlan: everything a runner needs for one engine step, as a header plus flat arrays.

The scheduler side builds a plan with numpy; every rank's runner reads it, copies the arrays
to its device once, and runs the forward. Runners never see ``Sequence`` objects, and plans
never go through pickle: they are encoded as

    +------------+------------+-----------------+-----+----------+-----+----------+
    | magic  u32 | hlen   u32 | msgpack header  | pad | array 0  | pad | array 1  | ...
    +------------+------------+-----------------+-----+----------+-----+----------+
                                each array starts on an 8-byte boundary

The header holds the scalar fields and, per array, ``[name, shape, offset]`` with the offset
counted from the start of the array area (the first 8-byte boundary after the header); dtypes
are fixed per name (ARRAY_FIELDS).
``StepPlan.read_from`` returns numpy views into the buffer (no copy).

Arrays (B = num_seqs in the batch, T = num_tokens, S = sequences sampled this step):

    input_ids     int32 [T]     token ids to run
    positions     int32 [T]     their positions in their sequences
    slot_mapping  int32 [T]     KV-cache slot (block_id * block_size + offset) per token; -1 = skip
    cu_seqlens_q  int32 [B+1]   prefix sums of query lengths (new tokens per sequence)
    cu_seqlens_k  int32 [B+1]   prefix sums of key lengths (cached context + new tokens)
    context_lens  int32 [B]     key length per sequence (== diff of cu_seqlens_k)
    block_tables  int32 [B, W]  physical block ids per sequence, padded with -1
    logits_indices int32 [S]    rows of the hidden states whose logits are sampled
    temperatures  float32 [S]   0 = greedy
    top_ks        int32 [S]     <= 0 = disabled
    top_ps        float32 [S]   1.0 = disabled
    seeds         int64 [S]     per-request seed of the counter-based sampler
    sample_steps  int32 [S]     index of the token being sampled within its request's output

Notes for runners:
    * A token row with slot -1 already has its K/V in the cache (a prompt fully covered by the
      prefix cache recomputes only its last token); such plans set ``has_context``, so attention
      reads keys through the block tables.
    * ``has_context`` is always False for decode plans (decode always reads the cache).
    * Decode plans may share read-only arrays between consecutive steps: copy, never write.
"""
from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass, field

import msgpack
import numpy as np

MAGIC = 0x7470_5331  # "tpS1"
_PREFIX = struct.Struct("<II")
_ALIGN = 8


class Command(enum.IntEnum):
    """What a plan asks the runners to do. Only these; no dispatch by method name."""

    STEP = 0
    SHUTDOWN = 1
    RESET_PREFIX_CACHE = 2
    PROFILE_START = 3
    PROFILE_STOP = 4
    PING = 5


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
    "temperatures": np.dtype(np.float32),
    "top_ks": np.dtype(np.int32),
    "top_ps": np.dtype(np.float32),
    "seeds": np.dtype(np.int64),
    "sample_steps": np.dtype(np.int32),
}


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
    # Free-form scalars for control commands (e.g. a profile output path).
    args: dict = field(default_factory=dict)
    input_ids: np.ndarray = field(default_factory=lambda: _empty("input_ids"))
    positions: np.ndarray = field(default_factory=lambda: _empty("positions"))
    slot_mapping: np.ndarray = field(default_factory=lambda: _empty("slot_mapping"))
    cu_seqlens_q: np.ndarray = field(default_factory=lambda: _empty("cu_seqlens_q", (1,)))
    cu_seqlens_k: np.ndarray = field(default_factory=lambda: _empty("cu_seqlens_k", (1,)))
    context_lens: np.ndarray = field(default_factory=lambda: _empty("context_lens"))
    block_tables: np.ndarray = field(default_factory=lambda: _empty("block_tables", (0, 0)))
    logits_indices: np.ndarray = field(default_factory=lambda: _empty("logits_indices"))
    temperatures: np.ndarray = field(default_factory=lambda: _empty("temperatures"))
    top_ks: np.ndarray = field(default_factory=lambda: _empty("top_ks"))
    top_ps: np.ndarray = field(default_factory=lambda: _empty("top_ps"))
    seeds: np.ndarray = field(default_factory=lambda: _empty("seeds"))
    sample_steps: np.ndarray = field(default_factory=lambda: _empty("sample_steps"))

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
        b, t, s = self.num_seqs, self.num_tokens, self.num_samples
        expect = {"positions": (t,), "slot_mapping": (t,), "cu_seqlens_q": (b + 1,),
                  "cu_seqlens_k": (b + 1,), "temperatures": (s,), "top_ks": (s,),
                  "top_ps": (s,), "seeds": (s,), "sample_steps": (s,)}
        for name, shape in expect.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"plan field {name}: expected shape {shape}, got "
                                 f"{getattr(self, name).shape}")
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != b:
            raise ValueError(f"plan field block_tables: expected shape ({b}, W), got "
                             f"{self.block_tables.shape}")

    # ---- encoding ------------------------------------------------------------------------
    def _layout(self) -> tuple[bytes, list[tuple[np.ndarray, int]], int]:
        arrays = [np.ascontiguousarray(getattr(self, n)) for n in ARRAY_FIELDS]
        # Offsets depend on the header length, which depends on the offsets: encode the
        # header once with offsets relative to the array area, then shift by its size.
        rel, entries, pos = [], [], 0
        for name, arr in zip(ARRAY_FIELDS, arrays):
            pos = -(-pos // _ALIGN) * _ALIGN
            entries.append([name, arr.shape, pos])
            rel.append((arr, pos))
            pos += arr.nbytes
        header = msgpack.packb({
            "cmd": int(self.cmd), "is_prefill": self.is_prefill, "has_context": self.has_context,
            "max_seqlen_q": self.max_seqlen_q, "max_seqlen_k": self.max_seqlen_k,
            "step_id": self.step_id, "args": self.args,
            "arrays": [[n, list(shape), off] for n, shape, off in entries],
        })
        base = -(-(_PREFIX.size + len(header)) // _ALIGN) * _ALIGN
        return header, [(a, base + off) for a, off in rel], base + pos

    def nbytes(self) -> int:
        return self._layout()[2]

    def write_into(self, buf) -> int:
        """Encode into the writable buffer ``buf``; returns the number of bytes written."""
        header, placed, total = self._layout()
        mv = memoryview(buf).cast("B")
        if len(mv) < total:
            raise ValueError(f"buffer of {len(mv)} bytes is too small for a {total}-byte plan")
        _PREFIX.pack_into(mv, 0, MAGIC, len(header))
        mv[_PREFIX.size:_PREFIX.size + len(header)] = header
        for arr, off in placed:
            if arr.nbytes:
                mv[off:off + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        return total

    def to_bytes(self) -> bytes:
        out = bytearray(self.nbytes())
        self.write_into(out)
        return bytes(out)

    @classmethod
    def read_from(cls, buf) -> "StepPlan":
        """Decode a plan; arrays are read-only views into ``buf`` (copy them to keep them)."""
        mv = memoryview(buf).cast("B")
        magic, hlen = _PREFIX.unpack_from(mv, 0)
        if magic != MAGIC:
            raise ValueError(f"not a StepPlan buffer (magic {magic:#x})")
        h = msgpack.unpackb(mv[_PREFIX.size:_PREFIX.size + hlen], strict_map_key=False)
        base = -(-(_PREFIX.size + hlen) // _ALIGN) * _ALIGN
        arrays = {}
        for name, shape, off in h["arrays"]:
            arrays[name] = np.frombuffer(mv, dtype=ARRAY_FIELDS[name], count=math.prod(shape),
                                         offset=base + off).reshape(shape)
        return cls(cmd=Command(h["cmd"]), is_prefill=h["is_prefill"], has_context=h["has_context"],
                   max_seqlen_q=h["max_seqlen_q"], max_seqlen_k=h["max_seqlen_k"],
                   step_id=h["step_id"], args=h["args"], **arrays)

    @classmethod
    def from_bytes(cls, data: bytes) -> "StepPlan":
        return cls.read_from(data)
