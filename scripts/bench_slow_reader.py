"""A slowly reading client: is it dropped, and does each of its requests get its final message?

    python scripts/bench_slow_reader.py [--model DIR] [--requests 200] [--tokens 64]
                                        [--interval 5] [--slow-for 45] [--quiet 20]

One daemon (`tpserve start`, the bundled model by default). One connection (default ZeroMQ
options) sends ``--requests`` streamed requests of ``--tokens`` tokens each (ignore_eos), then
reads one message every ``--interval`` seconds for ``--slow-for`` seconds (longer than the 30 s
after which tpserve used to drop a client as "not reading"), then reads as fast as it can until
every request has its final message or nothing came for ``--quiet`` seconds.

Prints one line: messages and finals received, how many requests got all their tokens
(deltas concatenated), whether the client was dropped (some request never got its final message
and the daemon has nothing in flight), and the elapsed time from the first request to the last
message.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import msgpack
import zmq

from bench_daemon_run import isa, on_daemon


def run(address: str, args) -> dict:
    from tpserve.client.client import Client

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    tokens = {f"r{i}": 0 for i in range(args.requests)}
    finals: dict[str, str] = {}
    messages = 0
    try:
        start = last = time.perf_counter()
        for i, rid in enumerate(tokens):
            sock.send(msgpack.packb({"v": 1, "type": "generate", "id": rid, "prompt": [11 + i % 900, 12, 13, 14],
                                     "stream": True, "params": {"max_tokens": args.tokens, "temperature": 0.0,
                                                                "ignore_eos": True}}))

        def take(timeout_s: float) -> bool:
            nonlocal messages, last
            if not sock.poll(int(timeout_s * 1000)):
                return False
            m = msgpack.unpackb(sock.recv())
            messages += 1
            last = time.perf_counter()
            if m["type"] == "delta":
                tokens[m["id"]] += len(m["token_ids"])
            elif m["type"] in ("done", "error"):
                if m["id"] in finals:
                    raise RuntimeError(f"two final messages for {m['id']}")
                finals[m["id"]] = m["type"]
            return True

        slow_until = start + args.slow_for
        while time.perf_counter() < slow_until and len(finals) < args.requests:
            take(args.interval)
            time.sleep(max(0.0, min(args.interval, slow_until - time.perf_counter())))
        while len(finals) < args.requests and take(args.quiet):
            pass
        with Client(address, timeout=60) as other:
            in_flight = other.status()["requests_in_flight"]
    finally:
        sock.close()
        ctx.term()
    return dict(messages=messages, finals=len(finals), complete=sum(n == args.tokens for n in tokens.values()),
                dropped=len(finals) < args.requests and in_flight == 0, elapsed=last - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--slow-for", type=float, default=45.0)
    ap.add_argument("--quiet", type=float, default=20.0)
    args = ap.parse_args()
    r = on_daemon(args.model, lambda address: run(address, args))
    print(f"bench_slow_reader model={os.path.basename(args.model or 'default-model')} isa={isa()} "
          f"requests={args.requests}x{args.tokens} read_every_s={args.interval:g} for_s={args.slow_for:g} "
          f"messages={r['messages']} finals={r['finals']}/{args.requests} "
          f"complete={r['complete']}/{args.requests} dropped={'yes' if r['dropped'] else 'no'} "
          f"elapsed_s={r['elapsed']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
