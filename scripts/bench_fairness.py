"""Fairness across connections, and requests of a vanished client.

    python scripts/bench_fairness.py [--model DIR] [--flood 20000] [--vanish 100] [--vanish-tokens 900]

One daemon (`tpserve start`, the bundled model by default), three phases:

1. idle: one request (8 prompt tokens, 16 new) on an idle daemon; its latency is the baseline.
2. flood: one connection queues ``--flood`` non-streaming requests (8 prompt tokens, 1 new
   token each) at once; as soon as the daemon has answered the first of them, another
   connection sends the same request as in phase 1. Its latency is how long a client waits
   behind another client's queue.
3. vanish: a connection sends ``--vanish`` non-streaming requests of ``--vanish-tokens`` tokens
   (ignore_eos) and closes its socket right away; counts the tokens the daemon still generates
   for nobody until it is idle.

Prints one line. Timings depend on the machine's load: compare runs made back to back.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import msgpack
import zmq

from bench_daemon_run import isa, on_daemon



def _generate(rid: str, prompt: list[int], max_tokens: int, stream: bool = False, **params) -> bytes:
    return msgpack.packb({"v": 1, "type": "generate", "id": rid, "prompt": prompt, "stream": stream,
                          "params": {"max_tokens": max_tokens, "temperature": 0.0, **params}})


def _wait_one(client, prompt) -> float:
    start = time.perf_counter()
    client.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
    return time.perf_counter() - start


def _wait_idle(client, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = client.status()
        if stats["requests_in_flight"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def run(address: str, args) -> tuple[float, float, int, float]:
    from tpserve.client.client import Client

    ctx = zmq.Context()
    try:
        with Client(address, timeout=600) as other:
            _wait_one(other, [7] * 8)  # warm-up
            idle = _wait_one(other, [9] * 8)

            flood = ctx.socket(zmq.DEALER)
            flood.setsockopt(zmq.SNDHWM, 0)
            flood.setsockopt(zmq.RCVHWM, 0)
            flood.connect(address)
            for i in range(args.flood):
                flood.send(_generate(f"f{i}", [1 + i % 4000, 2, 3, 4, 5, 6, 7, 8], 1))
            flood.poll(600_000)  # the daemon is serving the flood now
            waited = _wait_one(other, [9] * 8)
            answered = 0
            while answered < args.flood and flood.poll(600_000):
                if msgpack.unpackb(flood.recv())["type"] in ("done", "error"):
                    answered += 1
            flood.close(linger=0)

            before = other.status()["generation_tokens"]
            gone = ctx.socket(zmq.DEALER)
            gone.connect(address)
            for i in range(args.vanish):
                gone.send(_generate(f"v{i}", [11 + i, 12, 13, 14, 15, 16, 17, 18], args.vanish_tokens,
                                    ignore_eos=True))
            time.sleep(0.2)  # let the frames reach the daemon before the connection goes
            gone.close(linger=0)
            start = time.perf_counter()
            stats = _wait_idle(other, 600)
            idle_after = time.perf_counter() - start
            for_nobody = stats["generation_tokens"] - before
    finally:
        ctx.term()
    return idle, waited, for_nobody, idle_after


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--flood", type=int, default=20000)
    ap.add_argument("--vanish", type=int, default=100)
    ap.add_argument("--vanish-tokens", type=int, default=900)
    args = ap.parse_args()
    idle, waited, for_nobody, idle_after = on_daemon(args.model, lambda address: run(address, args))
    print(f"bench_fairness model={os.path.basename(args.model or 'default-model')} isa={isa()} dtype=auto "
          f"idle_request_s={idle:.3f} flood={args.flood} other_client_wait_s={waited:.3f} "
          f"vanished={args.vanish}x{args.vanish_tokens} tokens_for_nobody={for_nobody} "
          f"busy_after_vanish_s={idle_after:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
