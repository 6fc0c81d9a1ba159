"""TorchAttention: the plain-torch attention backend (the CPU path; runs on any device).

Vectorised over tokens and sequences; the only Python loop is the caller's loop over layers.
Attention is batched ``scaled_dot_product_attention`` over a padded ``[B, H, L, D]`` layout,
which on CPU dispatches to torch's fused flash kernel (fp32 accumulation and softmax for
bf16/fp16 inputs, GQA via ``enable_gqa`` without copying K/V):

* prefill without context (and any run without a cache): the new q/k/v are scattered into
  ``[B, max_q]`` padding and attended with ``is_causal=True``. No mask tensor is needed because
  a real query i only sees keys 0..i, all real; padding rows compute garbage that is dropped.
  For ~64 sequences x 256 tokens this is one fused call, far cheaper than a block-diagonal
  ``[T, T]`` mask (64x more scores) or a per-sequence loop (64 calls). Sequences of very
  different lengths are split into at most 4 length groups, each padded to its own longest,
  so padding never more than doubles a sequence's work.
* decode and prefill with context: keys are gathered through the block tables into
  ``[B, max_k]`` (after the new tokens were stored), then attended with a boolean mask that
  is causal with the offset ``context_len - q_len`` and hides keys past ``context_len``
  (whose gathered rows are redirected to the sequence's key 0, see ``_paged_index``).

Index tensors (token -> sequence maps, gather slots, masks) depend only on the metadata, so
they are built once per step and cached on it (``AttentionMetadata.derived``).

A sliding window (attention_options.py) narrows the same masks (``q_pos - k_pos < window``).
Sinks and logit soft-capping are outside SDPA, so a layer with either attends with the same
padded layout and mask through explicit scores and softmax (``_masked_attention``).

An int8 cache (``kv_scales``, kv_quant.py) is dequantized after the gather; every row then reads
the cache, prompts without context too, so that a prompt attends to the same (quantized) keys
whether its prefix is recomputed or read from the prefix cache.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tpserve.kernels.attention_backend import AttentionBackend
from tpserve.kernels.attention_options import PLAIN, AttentionOptions
from tpserve.kernels.kv_quant import dequantize_int8
from tpserve.kernels.metadata import AttentionMetadata
from tpserve.kernels.torch_store import store_kvcache_torch


class TorchAttention(AttentionBackend):
    """Plain-torch paged attention; any block size >= 1.

    Keeps two scratch buffers for gathered keys/values, reused by every layer and step and
    grown to the largest gather seen: a fresh multi-MB allocation per layer costs more in page
    faults than the gather itself (measured ~3x on CPU for 64 x 512 keys).
    """

    name = "torch"
    options = frozenset({"window", "sinks", "softcap"})
    int8_kv = True
    # Index tensors are built from metadata values (host syncs) and cached per metadata object.
    supports_cuda_graphs = False

    def __init__(self, block_size: int = 16):
        super().__init__(block_size)
        self._scratch: dict[str, torch.Tensor] = {}

    def store(self, key, value, k_cache, v_cache, slot_mapping, kv_scales=None) -> None:
        store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping, kv_scales)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
               scale: float, opts: AttentionOptions = PLAIN, kv_scales=None) -> torch.Tensor:
        if k_cache is None or (meta.is_prefill and not meta.has_context and kv_scales is None):
            # The new tokens are whole sequences: attend over them directly, no gather.
            return varlen_causal_attention(q, k, v, meta, scale, opts)
        parts = meta.derived("torch.mixed_parts", lambda: split_decode_rows(meta)) \
            if meta.is_prefill else None
        if parts is not None:
            # A mixed step: padding the decode rows to the chunk's query length would multiply
            # their work by it, so decode rows and prefill rows are attended separately.
            (dmeta, dq), (pmeta, pq) = parts
            return torch.cat([
                paged_attention(q[:dq], k_cache, v_cache, dmeta, scale, scratch=self._buffer, opts=opts,
                                kv_scales=kv_scales),
                paged_attention(q[dq:], k_cache, v_cache, pmeta, scale, scratch=self._buffer, opts=opts,
                                kv_scales=kv_scales)])
        return paged_attention(q, k_cache, v_cache, meta, scale, scratch=self._buffer, opts=opts,
                               kv_scales=kv_scales)

    def _buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._scratch[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)


def _token_index(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence of each token, its row within the sequence's new tokens), both int64 [T]."""
    cu = meta.cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs, device=cu.device), q_lens,
                                  output_size=meta.num_tokens)
    pos = torch.arange(meta.num_tokens, device=cu.device) - cu[seq]
    return seq, pos


def _pad(x: torch.Tensor, meta: AttentionMetadata, max_len: int) -> torch.Tensor:
    """[T, H, D] flat tokens -> [B, H, max_len, D] (zero padded, or a view when uniform)."""
    b, (t, h, d) = meta.num_seqs, x.shape
    if t == b * max_len:  # every sequence has max_len tokens: a pure reshape
        return x.view(b, max_len, h, d).transpose(1, 2)
    seq, pos = meta.derived("torch.token_index", lambda: _token_index(meta))
    out = x.new_zeros(b, h, max_len, d)
    out[seq, :, pos] = x
    return out


def _unpad(o: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[B, H, max_len, D] -> [T, H, D], the inverse of ``_pad`` (always a new tensor)."""
    b, h, max_len, d = o.shape
    if meta.num_tokens == b * max_len:
        return o.transpose(1, 2).reshape(meta.num_tokens, h, d)
    seq, pos = meta.derived("torch.token_index", lambda: _token_index(meta))
    return o[seq, :, pos]


# Sequences of a prefill batch are grouped by length, each group padded only to its own
# longest: group g holds lengths in (max / 2**((g+1)/2), max / 2**(g/2)], so padding at most
# doubles a sequence's causal work, and the last group takes everything shorter.
MAX_LENGTH_GROUPS = 4


def _length_groups(meta: AttentionMetadata):
    """Per group: (token rows, group-local sequence of each row, row within it, #seqs, max len)."""
    cu = meta.cu_seqlens_q.long()
    lens = cu[1:] - cu[:-1]
    seq, pos = meta.derived("torch.token_index", lambda: _token_index(meta))
    ratio = meta.max_seqlen_q / lens.clamp(min=1).double()
    group = (2 * torch.log2(ratio)).floor().long().clamp(0, MAX_LENGTH_GROUPS - 1)
    out = []
    for g in torch.unique(group).tolist():  # at most MAX_LENGTH_GROUPS iterations
        members = (group == g).nonzero().squeeze(1)
        local = torch.full_like(group, -1)
        local[members] = torch.arange(members.numel(), device=group.device)
        rows = (group[seq] == g).nonzero().squeeze(1)
        out.append((rows, local[seq[rows]], pos[rows], members.numel(), int(lens[members].max())))
    return out


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            opts: AttentionOptions) -> torch.Tensor:
    """Causal attention over padded [B, H, L, D] tensors whose queries are their keys."""
    if opts.plain:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    pos = torch.arange(q.shape[2], device=q.device)
    mask = pos[None, :] <= pos[:, None]
    if opts.window is not None:
        mask &= pos[:, None] - pos[None, :] < opts.window
    return _masked_attention(q, k, v, mask, scale, opts)


SCORE_CHUNK_ELEMENTS = 1 << 25  # 128 MiB of fp32 scores per chunk of query rows


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, opts: AttentionOptions) -> torch.Tensor:
    """SDPA with a boolean mask, or for sinks / soft-capping the same with explicit scores.

    q [B, Hq, L, D], k/v [B, Hkv, S, D], mask broadcastable to [B, 1, L, S]. The explicit form
    follows transformers: soft-cap the scaled scores, mask, softmax with each head's sink as one
    more column, drop the sink's share.
    """
    if opts.sinks is None and opts.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    b, hq, length, d = q.shape
    hkv = k.shape[1]
    m = mask.expand(b, 1, length, mask.shape[-1]) if mask.dim() == 4 else mask[None, None].expand(
        b, 1, length, mask.shape[-1])
    qg = q.reshape(b, hkv, hq // hkv, length, d)
    kt, vg = k.unsqueeze(2).transpose(-1, -2), v.unsqueeze(2)
    # Query rows in chunks, so the explicit scores stay within ~SCORE_CHUNK_ELEMENTS floats.
    rows = max(1, SCORE_CHUNK_ELEMENTS // max(1, b * hq * k.shape[2]))
    out = []
    for r0 in range(0, length, rows):
        scores = torch.matmul(qg[..., r0:r0 + rows, :], kt) * scale          # [B, Hkv, G, R, S]
        if opts.softcap is not None:
            scores = torch.tanh(scores / opts.softcap) * opts.softcap
        scores = scores.masked_fill(~m[:, :, None, r0:r0 + rows], float("-inf"))
        if opts.sinks is not None:
            sink = opts.sinks.to(scores.dtype).view(1, hkv, hq // hkv, 1, 1).expand(
                *scores.shape[:-1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out.append(torch.matmul(probs, vg))
    return torch.cat(out, dim=3).reshape(b, hq, length, d)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            meta: AttentionMetadata, scale: float,
                            opts: AttentionOptions = PLAIN) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over themselves (cu_seqlens_q only)."""
    max_q = meta.max_seqlen_q
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        # Same arithmetic as paged_attention, which widens on CPU: a prompt must compute the same
        # values whether its prefix is recomputed here or read from the cache there.
        return varlen_causal_attention(q.float(), k.float(), v.float(), meta, scale, opts).to(q.dtype)
    groups = (None if meta.num_tokens == meta.num_seqs * max_q
              else meta.derived("torch.length_groups", lambda: _length_groups(meta)))
    if groups is None or len(groups) == 1:
        o = _causal(_pad(q, meta, max_q), _pad(k, meta, max_q), _pad(v, meta, max_q), scale, opts)
        return _unpad(o, meta)
    out = q.new_empty(q.shape)
    for rows, seq, pos, n, length in groups:
        padded = []
        for x in (q, k, v):
            xp = x.new_zeros(n, x.shape[1], length, x.shape[2])
            xp[seq, :, pos] = x[rows]
            padded.append(xp)
        o = _causal(*padded, scale, opts)
        out[rows] = o[seq, :, pos]
    return out


def _paged_index(meta: AttentionMetadata, block_size: int):
    """Gather slots [B * max_k] and the attention mask [B, 1, max_q, max_k]."""
    max_q, max_k = meta.max_seqlen_q, meta.max_seqlen_k
    width = meta.block_tables.shape[1]
    if width * block_size < max_k:
        raise ValueError(f"meta: block_tables has {width} columns of {block_size} slots, fewer "
                         f"than max_seqlen_k={max_k} keys")
    dev = meta.device
    kpos = torch.arange(max_k, device=dev)
    tables = meta.block_tables.long()
    slots = tables[:, kpos // block_size] * block_size + kpos % block_size
    k_lens = meta.context_lens.long()
    valid = kpos[None, :] < k_lens[:, None]
    # Positions past a sequence's length read its key 0 instead (always stored, so finite):
    # they are masked out, but the rows must hold finite numbers, because the cache may hold
    # uninitialised memory (NaN bit patterns) and a masked NaN value still poisons P @ V
    # (0 * NaN = NaN). Redirecting the index is free; zeroing the gathered rows is not.
    slots = torch.where(valid, slots, tables[:, :1] * block_size)
    cu = meta.cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    # Query row i of sequence b sits at absolute position k_len - q_len + i.
    qpos = (k_lens - q_lens)[:, None] + torch.arange(max_q, device=dev)[None, :]
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & valid[:, None, :]
    return slots.reshape(-1), mask[:, None]


def _window_index(meta: AttentionMetadata, block_size: int, window: int):
    """``_paged_index`` for a sliding window: the mask narrowed to each query's last ``window``
    keys, and the slots of keys before every query's window (whose blocks a cache may have
    freed) redirected to the sequence's last key, which is always held."""
    slots, mask = meta.derived(("torch.paged_index", block_size), lambda: _paged_index(meta, block_size))
    dev = mask.device
    cu = meta.cu_seqlens_q.long()
    k_lens = meta.context_lens.long()
    first_q = k_lens - (cu[1:] - cu[:-1])
    qpos = first_q[:, None] + torch.arange(meta.max_seqlen_q, device=dev)[None, :]
    kpos = torch.arange(meta.max_seqlen_k, device=dev)
    mask = mask & (qpos[:, :, None] - kpos[None, None, :] < window)[:, None]
    last = (k_lens - 1).clamp(min=0)
    tables = meta.block_tables.long()
    last_slot = tables.gather(1, (last // block_size)[:, None]) * block_size + (last % block_size)[:, None]
    held = (kpos[None, :] > first_q[:, None] - window) & (kpos[None, :] < k_lens[:, None])
    slots = torch.where(held, slots.view(meta.num_seqs, -1), last_slot)
    return slots.reshape(-1), mask


def split_decode_rows(meta: AttentionMetadata):
    """For a mixed plan (leading sequences with one query each, then longer ones): metadata
    and token count of the decode rows and of the rest, ((meta, T), (meta, T)); else None."""
    cu = meta.cu_seqlens_q
    b = meta.num_seqs
    nd = meta.num_decodes
    if nd is None:  # not stated by the plan: count the leading one-row sequences
        q_lens = (cu[1:] - cu[:-1]).tolist()
        nd = next((i for i, n in enumerate(q_lens) if n != 1), b)
    if nd == 0 or nd == b:
        return None
    ck, ctx, tables, slots = meta.cu_seqlens_k, meta.context_lens, meta.block_tables, meta.slot_mapping

    def part(lo, hi, t_lo, t_hi, is_prefill, max_q):
        return AttentionMetadata(
            is_prefill=is_prefill, has_context=is_prefill, cu_seqlens_q=cu[lo:hi + 1] - cu[lo],
            cu_seqlens_k=ck[lo:hi + 1] - ck[lo], max_seqlen_q=max_q,
            max_seqlen_k=int(ctx[lo:hi].max()), context_lens=ctx[lo:hi],
            block_tables=tables[lo:hi], slot_mapping=slots[t_lo:t_hi],
            num_decodes=hi - lo if not is_prefill else 0)

    t = meta.num_tokens
    # The decode rows' query length is 1, so the mixed step's longest is a prefill row's.
    return (part(0, nd, 0, nd, False, 1), nd), (part(nd, b, nd, t, True, meta.max_seqlen_q), t - nd)


def _new_buffer(name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, scratch=_new_buffer,
                    opts: AttentionOptions = PLAIN, kv_scales=None) -> torch.Tensor:
    """Attention of the new tokens over each sequence's keys read through its block table.

    ``scratch(name, shape, like)`` supplies the buffers the keys and values are gathered into.
    On CPU, bf16/fp16 keys are widened to fp32 after the gather: CPUs without native bf16
    arithmetic run the fused kernel ~8x slower in bf16 (measured: 64 seqs x 512 keys, 0.96 s
    vs 0.25 s including the conversion), and fp32 is what the softmax accumulates in anyway.
    An int8 cache (``kv_scales``) is dequantized after the gather, to fp32 on CPU.
    """
    nb, bs, hkv, d = k_cache.shape
    b, max_k = meta.num_seqs, meta.max_seqlen_k
    if opts.window is None:
        slots, mask = meta.derived(("torch.paged_index", bs), lambda: _paged_index(meta, bs))
    else:
        slots, mask = meta.derived(("torch.window_index", bs, opts.window),
                                   lambda: _window_index(meta, bs, opts.window))
    widen = q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
    gathered = []
    for i, (name, cache) in enumerate((("k", k_cache), ("v", v_cache))):
        buf = scratch(name, (b * max_k, hkv, d), cache)
        torch.index_select(cache.view(nb * bs, hkv, d), 0, slots, out=buf)
        if kv_scales is not None:
            s = torch.index_select(kv_scales[i].view(nb * bs, hkv), 0, slots)
            buf = dequantize_int8(buf, s, torch.float32 if widen or q.device.type == "cpu" else q.dtype)
            widen = widen or q.dtype != buf.dtype
        elif widen:
            buf = scratch(name + "32", buf.shape, buf.new_empty(0, dtype=torch.float32)).copy_(buf)
        gathered.append(buf.view(b, max_k, hkv, d).transpose(1, 2))
    qp = _pad(q, meta, meta.max_seqlen_q)
    o = _masked_attention(qp.float() if widen else qp, gathered[0], gathered[1], mask, scale, opts)
    return _unpad(o.to(q.dtype), meta)
