#!/usr/bin/env python3
"""pyzmq replay client for a vLLM-style KV-event replay socket (ROUTER).

Usage: kv_events_replay.py --endpoint tcp://127.0.0.1:PORT --start SEQ [--timeout S]

Sends [b"", start_seq (8 bytes BE)] from a DEALER (the envelope a REQ socket
produces, which vllm/distributed/kv_events.py _service_replay requires; a REQ
socket would only accept the first of the many replies) and reads replies
until the end marker (seq = -1, empty payload). Accepts both reply framings:
[topic, seq, payload] (vLLM >= PR #45177) and legacy [seq, payload].
Prints one JSON line per batch {"seq", "topic" (or null), "batch", "encoding"}
then {"end": true, "count": n}. Exits 2 on timeout; every wait is bounded.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_events_common as common  # noqa: E402

try:
    import zmq
except ImportError:  # pragma: no cover
    print("pyzmq missing: run scripts/install-test-deps.sh", file=sys.stderr)
    sys.exit(3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--start", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args()

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(args.endpoint)
    dealer.send_multipart([b"", args.start.to_bytes(8, "big")])
    deadline = time.time() + args.timeout
    count = 0
    while True:
        left = deadline - time.time()
        if left <= 0 or not dealer.poll(int(left * 1000)):
            print(f"timed out after {count} replayed batches", file=sys.stderr)
            sys.exit(2)
        frames = dealer.recv_multipart()
        if frames and frames[0] == b"":
            frames = frames[1:]
        if len(frames) == 3:
            topic, seq_b, payload = frames
        elif len(frames) == 2:
            topic, (seq_b, payload) = None, frames
        else:
            print(f"bad replay reply with {len(frames)} frames", file=sys.stderr)
            sys.exit(1)
        seq = int.from_bytes(seq_b, "big", signed=True)
        if seq == -1:
            if payload:
                print("end marker with non-empty payload", file=sys.stderr)
                sys.exit(1)
            print(json.dumps({"end": True, "count": count}), flush=True)
            break
        batch, enc, _ = common.batch_from_payload(payload)
        print(json.dumps({
            "seq": seq,
            "topic": None if topic is None else topic.decode("utf-8", "replace"),
            "batch": batch,
            "encoding": enc,
        }), flush=True)
        count += 1
    dealer.close()
    ctx.term()


if __name__ == "__main__":
    main()
