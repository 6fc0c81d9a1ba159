"""Scheduling orders: who is preempted when blocks run short, under ``fcfs`` and ``priority``.

``fcfs`` is the seed: admission first come, first served (``WaitingQueue``), and a decode that
needs a block preempts the tail of ``running`` (the latest admitted), or itself when nothing is
left behind it.

``priority`` (vLLM's meaning: a lower value is served first; every request has one, default
0) changes two decisions and nothing else:

* admission takes waiting sequences by (priority, arrival) (``WaitingQueue``); and when the
  best waiting sequence cannot be admitted for lack of KV blocks or of a slot
  (``max_num_seqs``), running sequences of a worse priority are preempted by the seed's
  ``preempt`` until it fits (``admission_victims``): worst priority first, the latest
  admitted among equals (the seed's tail rule). Nobody is preempted when even all of them
  would not make room, and never a sequence of the same or a better priority;
* a decode that needs a block takes its victim among the sequences behind it the same way
  (``decode_victim``); when every one of them has a better priority than itself, it preempts
  itself, as the seed does when nothing is left behind it.

With every priority equal both rules pick exactly the seed's victims, so the two orders make
the same decisions. Within one priority nothing starves: that queue is first come, first
served. Across priorities the order is strict: a steady stream of better-priority work keeps
worse-priority work waiting (as in vLLM).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

SCHEDULING_ORDERS = ("fcfs", "priority")


def _worst_first(candidates: Iterable) -> list:
    """``candidates`` (in admission order) sorted worst priority first, latest admitted first
    among equals."""
    indexed = list(enumerate(candidates))
    indexed.sort(key=lambda p: (-p[1].priority, -p[0]))
    return [s for _, s in indexed]


def decode_victim(rest, seq, by_priority: bool):
    """The sequence of ``rest`` (the running sequences behind ``seq``, a RunningQueue) that
    ``seq``'s decode preempts for a block, taken out of ``rest``; None: ``seq`` preempts
    itself. fcfs: the tail of ``rest``."""
    if not rest:
        return None
    if not by_priority:
        return rest.pop()
    victim = None
    for s in rest:  # worst priority, latest admitted among equals
        if victim is None or s.priority >= victim.priority:
            victim = s
    if victim.priority < seq.priority:
        return None  # everyone behind is better: seq is the one to go
    if victim is rest[-1]:
        return rest.pop()
    rest.remove(victim)
    return victim


def admission_victims(head, running: Iterable, bm, use_cache: bool, free_blocks: int,
                      need_slot: bool, reserved: Callable[[object], bool]) -> list | None:
    """Running sequences to preempt so that ``head`` can be admitted, fewest first in the
    order of the module docstring; [] when it fits as things are, None when no choice of
    worse-priority victims makes it fit.

    ``free_blocks``: free blocks less those this step's decodes take first (``reserved(s)``:
    sequence ``s`` is one of those decodes, so preempting it also gives its block back).
    ``need_slot``: ``running`` is at ``max_num_seqs``, so at least one victim is needed.

    The block count is exact, prefix cache included: a block is freed when every sequence
    holding it is a victim; a prefix-cache hit of ``head`` on a block that is still used costs
    nothing, on a block that its victims free it costs a free block (``BlockManager.can_allocate``).
    """
    blocks = bm.blocks
    if bm.grouped:  # KV-cache groups: every group's hits and blocks (BlockManager.group_hits)
        k, group_hits = bm.group_hits(head, use_cache)
        hits = [b for ids in group_hits for b in ids if b != -1]
        need = bm.grouped_cost(head, k, group_hits)
    else:
        hits = bm.prefix_hits(head, use_cache)
        need = head.num_blocks - sum(1 for b in hits if blocks[b].ref_count > 0)
    hit_set = set(hits)
    free = free_blocks
    if free >= need and not need_slot:
        return []
    held: Counter = Counter()
    victims = []
    for v in _worst_first(s for s in running if s.priority > head.priority):
        victims.append(v)
        free += reserved(v) * bm.blocks_per_append
        for b in (v.block_table if not bm.grouped else [b for t in bm.tables(v) for b in t if b != -1]):
            held[b] += 1
            if held[b] == blocks[b].ref_count:
                free += 1
                need += b in hit_set
        if free >= need:
            return victims
    return None
