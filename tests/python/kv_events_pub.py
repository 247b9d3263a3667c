#!/usr/bin/env python3
"""pyzmq publisher emitting vLLM-format KV-event frames from a JSON script.

Usage:
  kv_events_pub.py --endpoint tcp://127.0.0.1:PORT --script FILE|- [options]

Frames are exactly what vllm/distributed/kv_events.py ZmqEventPublisher sends:
multipart [topic, seq (u64 big-endian), msgpack payload], seq counting batches
from 0. The socket is an XPUB (same wire format as PUB) so the script can wait
for subscriptions instead of sleeping (ZMQ slow joiner): with
``--wait-subscribers N`` nothing is sent before N subscription messages arrive.

Optional replay socket (``--replay-endpoint``, ROUTER, as vLLM's
_service_replay): a request [identity, "", start_seq 8 bytes BE] is answered
with one message per buffered batch with seq >= start and an end marker
(seq = -1), in ``--replay-framing topic`` ([id, "", topic, seq, payload], end
[id, "", "", -1, ""], vLLM >= PR #45177) or ``legacy`` ([id, "", seq, payload],
end [id, "", -1, ""]).

Script (JSON object): {"encoding": "array"|"map" (default for steps),
 "steps": [step...]} where a step is one of
  {"batch": <canonical batch JSON>, "encoding": .., "array_fields": n,
   "batch_fields": 2|3}                 publish one batch
  {"batch": ..., "drop": true}           consume the seq and buffer it for
                                          replay but do not send (a gap)
  {"payload_hex": "..."}                 publish raw payload bytes
  {"skip_seq": true}                     consume a seq, send/buffer nothing
  {"reset_seq": true}                    restart: seq back to 0, buffer cleared
  {"set_seq": n}                         the next batch gets seq n (buffer kept: a
                                          seq that goes back without a restart)
  {"sleep_ms": n}                        pause
A bare JSON list is taken as the steps. After the script, the publisher keeps
serving replay requests until ``--linger`` seconds pass or, with
``--exit-on-stdin-eof`` (needs --script FILE), stdin closes.
Stdout: first {"endpoint": .., "replay_endpoint": ..} once bound (use port
``*``, e.g. tcp://127.0.0.1:*, to let the OS pick), then
{"done": true, "published": n, "next_seq": n} after the script; with
``--verbose`` one line per step goes to stderr.
Loopback addresses only; every wait is bounded by ``--timeout``.
"""
import argparse
import json
import os
import select
import sys
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_events_common as common  # noqa: E402

try:
    import zmq
except ImportError:  # pragma: no cover
    print("pyzmq missing: run scripts/install-test-deps.sh", file=sys.stderr)
    sys.exit(3)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay-endpoint")
    ap.add_argument("--replay-framing", choices=["topic", "legacy"], default="topic")
    ap.add_argument("--topic", default="")
    ap.add_argument("--script", required=True, help="JSON file, or - for stdin")
    ap.add_argument("--encoding", choices=["array", "map"], default=None)
    ap.add_argument("--wait-subscribers", type=int, default=1)
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--linger", type=float, default=0.5)
    ap.add_argument("--exit-on-stdin-eof", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()

    if args.script == "-":
        script = json.load(sys.stdin)
    else:
        with open(args.script) as f:
            script = json.load(f)
    if isinstance(script, list):
        script = {"steps": script}
    default_enc = args.encoding or script.get("encoding", "map")
    deadline = time.time() + args.timeout

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 1000)
    pub.bind(args.endpoint)
    replay = None
    if args.replay_endpoint:
        replay = ctx.socket(zmq.ROUTER)
        replay.setsockopt(zmq.LINGER, 1000)
        replay.bind(args.replay_endpoint)
    print(json.dumps({
        "endpoint": pub.getsockopt_string(zmq.LAST_ENDPOINT),
        "replay_endpoint": replay.getsockopt_string(zmq.LAST_ENDPOINT) if replay else None,
    }), flush=True)
    topic = args.topic.encode()
    buffer = deque(maxlen=args.buffer_steps)

    def service_replay():
        frames = replay.recv_multipart()
        if len(frames) != 3:  # vLLM rejects anything but [id, "", start]
            return
        client_id, _, start_b = frames
        start = int.from_bytes(start_b, "big")
        for seq, buf in buffer:
            if seq >= start:
                body = [seq.to_bytes(8, "big"), buf]
                if args.replay_framing == "topic":
                    body = [topic] + body
                replay.send_multipart([client_id, b""] + body)
        end = [END_SEQ, b""] if args.replay_framing == "legacy" else [b"", END_SEQ, b""]
        replay.send_multipart([client_id, b""] + end)

    poller = zmq.Poller()
    poller.register(pub, zmq.POLLIN)
    if replay is not None:
        poller.register(replay, zmq.POLLIN)

    def pump(wait_ms):
        for sock, _ in poller.poll(wait_ms):
            if sock is pub:
                msg = pub.recv()
                if msg[:1] == b"\x01":
                    pump.subs += 1
            elif sock is replay:
                service_replay()

    pump.subs = 0
    while pump.subs < args.wait_subscribers:
        if time.time() > deadline:
            print("timed out waiting for subscribers", file=sys.stderr)
            sys.exit(2)
        pump(50)

    seq = 0
    published = 0
    for step in script["steps"]:
        if time.time() > deadline:
            print("timed out running the script", file=sys.stderr)
            sys.exit(2)
        pump(0)
        if "sleep_ms" in step:
            end = time.time() + step["sleep_ms"] / 1000.0
            while time.time() < end:
                pump(max(1, int((end - time.time()) * 1000)))
            continue
        if step.get("reset_seq"):
            seq = 0
            buffer.clear()
            continue
        if step.get("skip_seq"):
            seq += 1
            continue
        if "set_seq" in step:
            seq = int(step["set_seq"])
            continue
        if "payload_hex" in step:
            payload = bytes.fromhex(step["payload_hex"])
        else:
            kw = {}
            if "array_fields" in step:
                kw["array_fields"] = step["array_fields"]
            if "batch_fields" in step:
                kw["batch_fields"] = step["batch_fields"]
            payload = common.encode_batch(step["batch"], step.get("encoding", default_enc), **kw)
        if not step.get("drop"):
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
            published += 1
        if args.verbose:
            print(json.dumps({"seq": seq, "sent": not step.get("drop")}), file=sys.stderr)
        buffer.append((seq, payload))
        seq += 1

    print(json.dumps({"done": True, "published": published, "next_seq": seq}), flush=True)
    linger_end = min(deadline, time.time() + args.linger)
    while True:
        if args.exit_on_stdin_eof:
            if time.time() > deadline:
                break
            r, _, _ = select.select([sys.stdin], [], [], 0)
            if r and not sys.stdin.readline():
                break
        elif time.time() > linger_end:
            break
        pump(20)
    pub.close()
    if replay is not None:
        replay.close()
    ctx.term()


if __name__ == "__main__":
    main()
