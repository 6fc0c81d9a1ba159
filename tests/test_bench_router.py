"""scripts/bench_router.py's prefix-hit ceilings of the shared-prefix scenario: what a request
order allows two replicas to hit, checked on orders small enough to count by hand. No server
or router is started."""
from __future__ import annotations

import random
import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_router  # noqa: E402

SYSTEM, BLOCK = 40, 16  # two full blocks of a 40-token system prompt can be cached: 32 tokens


def requests(order: str, turn: int = 8):
    """One request per letter: the letter's system prompt then ``turn`` tokens of its own."""
    prompts = {c: [10 * (ord(c) - 64)] * SYSTEM for c in set(order)}
    return [(0.0, prompts[c] + [1] * turn, 4) for c in order]


def test_prompts_that_all_fit_hit_on_every_turn_after_the_first():
    reqs = requests("ABABA")
    got = bench_router.prefix_hit_ceilings(reqs, SYSTEM, BLOCK, pool_prompts=1)
    total = 5 * (SYSTEM + 8)
    # one prompt per replica: A and B are always split, so both keep theirs
    assert got == pytest.approx({"no_eviction": 3 * 32 / total, "split_lru": 3 * 32 / total,
                                 "offline_optimum": 3 * 32 / total})


def test_eviction_separates_the_three_ceilings():
    # four prompts, one slot per replica: every 2 + 2 split evicts A and B before they return,
    # while knowing the future keeps A (needed again first) through C and D
    got = bench_router.prefix_hit_ceilings(requests("ABCDAB"), SYSTEM, BLOCK, pool_prompts=1)
    total = 6 * (SYSTEM + 8)
    assert got == pytest.approx({"no_eviction": 2 * 32 / total, "split_lru": 0.0,
                                 "offline_optimum": 1 * 32 / total})


def test_split_lru_averages_over_the_splits():
    # three prompts, one slot per replica, split 1 + 2 in three ways: A keeps its slot for its
    # second turn only when it is the one alone (C and D share the other replica); alone with C
    # or D, A is evicted by it. Mean: 1/3 of a hit.
    got = bench_router.prefix_hit_ceilings(requests("ACDA"), SYSTEM, BLOCK, pool_prompts=1)
    total = 4 * (SYSTEM + 8)
    assert got["split_lru"] == pytest.approx(32 / total / 3)
    assert got["no_eviction"] == pytest.approx(32 / total)


@pytest.mark.parametrize("pool, seed", [(3, 0), (3, 1), (5, 0)])
def test_ceilings_of_the_benchmark_order_are_ordered(pool, seed):
    args = Namespace(system_tokens=1500, turns=6, max_tokens=8)
    reqs = bench_router.shared_prefix_requests(args, 32768, random.Random(seed))
    got = bench_router.prefix_hit_ceilings(reqs, 1500, 16, pool)
    assert 0 < got["split_lru"] <= got["offline_optimum"] <= got["no_eviction"] < 1
    if pool >= 4:  # four prompts per replica fit: nothing is ever evicted
        assert got["split_lru"] == pytest.approx(got["no_eviction"])
    else:
        assert got["split_lru"] < got["offline_optimum"] < got["no_eviction"]
