#!/usr/bin/env python3
"""pyzmq subscriber for vLLM-format KV-event frames; prints JSON lines.

Usage:
  kv_events_sub.py --endpoint tcp://127.0.0.1:PORT [--topic T] [--count N]
                   [--until-ts TS] [--timeout S]

Connects a SUB socket, subscribes to the topic prefix, and for each message
[topic, seq (u64 BE), msgpack payload] prints one line:
  {"topic": str, "seq": int, "encoding": "array"|"map"|"mixed"|null,
   "skipped_unknown": int, "batch": <canonical batch JSON>}
Decoding uses plain ``msgpack`` and the layouts of
vllm/distributed/kv_events.py (see kv_events_common.py). Before the first
message it prints {"ready": true} once connected. Exits 0 after N messages,
or after a batch whose ts equals --until-ts, and exits 2 on timeout (every
wait is bounded). A malformed message prints {"error": ...} and continues.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_events_common as common  # noqa: E402

try:
    import msgpack  # noqa: F401
    import zmq
except ImportError:  # pragma: no cover
    print("pyzmq/msgpack missing: run scripts/install-test-deps.sh", file=sys.stderr)
    sys.exit(3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--topic", default="")
    ap.add_argument("--count", type=int, default=0, help="exit after N messages (0: no limit)")
    ap.add_argument("--until-ts", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=20.0)
    args = ap.parse_args()

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    sub.connect(args.endpoint)
    print(json.dumps({"ready": True}), flush=True)

    deadline = time.time() + args.timeout
    received = 0
    code = 2
    while time.time() < deadline:
        if not sub.poll(min(100, max(1, int((deadline - time.time()) * 1000)))):
            continue
        frames = sub.recv_multipart()
        try:
            topic, seq_b, payload = frames
            if len(seq_b) != 8:
                raise ValueError(f"seq frame of {len(seq_b)} bytes")
            seq = int.from_bytes(seq_b, "big")
            batch, enc, skipped = common.batch_from_payload(payload)
        except Exception as e:  # noqa: BLE001 - report and keep going
            print(json.dumps({"error": repr(e)}), flush=True)
            continue
        line = {
            "topic": topic.decode("utf-8", "replace"),
            "seq": seq,
            "encoding": enc,
            "skipped_unknown": skipped,
            "batch": batch,
        }
        print(json.dumps(line), flush=True)
        received += 1
        if args.count and received >= args.count:
            code = 0
            break
        if args.until_ts is not None and batch["ts"] == args.until_ts:
            code = 0
            break
    if code != 0:
        print(f"timed out after {received} messages", file=sys.stderr)
    sub.close()
    ctx.term()
    sys.exit(code)


if __name__ == "__main__":
    main()
