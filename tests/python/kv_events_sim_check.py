#!/usr/bin/env python3
"""Subscribes with pyzmq to a running `kvmesh sim`'s KV events, drives a workload larger than
its cache (with the drop_events fault on for two requests), fills the gaps from the replay
socket, and checks that the events reproduce the engine's cache exactly.

Usage: kv_events_sim_check.py BASE_URL PUB_ENDPOINT REPLAY_ENDPOINT MODEL ENCODING
  ENCODING: array | map (what the sim was started with; the decoder checks it)

Decoding is written here from vLLM's format only (it shares no code with the Rust side):
frames [topic, seq u64 BE, msgpack [ts, events, dp_rank]], events tagged by class name
(array: ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name, ...];
map: {"type": "BlockStored", ...}). Missed batches (ZMQ slow joiner) are fetched from the
replay socket. Loopback only; every wait is bounded.
"""
import json
import struct
import sys
import time
import urllib.request

import msgpack
import zmq


def fail(msg):
    print(f"FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def http(method, url, payload=None):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read()
        return json.loads(body) if body else None


def decode_event(ev, encoding):
    if encoding == "array":
        if not isinstance(ev, list):
            fail(f"array encoding expected, got {type(ev)}")
        tag = ev[0]
        if tag == "BlockStored":
            return {"type": tag, "block_hashes": ev[1], "parent_block_hash": ev[2],
                    "token_ids": ev[3], "block_size": ev[4],
                    "lora_name": ev[7] if len(ev) > 7 else None}
        if tag == "BlockRemoved":
            return {"type": tag, "block_hashes": ev[1]}
        if tag == "AllBlocksCleared":
            return {"type": tag}
        fail(f"unknown tag {tag}")
    if not isinstance(ev, dict):
        fail(f"map encoding expected, got {type(ev)}")
    return ev


def apply(mirror, events, stats):
    for ev in events:
        t = ev["type"]
        if t == "BlockStored":
            hashes, parent, toks, bs = (ev["block_hashes"], ev["parent_block_hash"],
                                        ev["token_ids"], ev["block_size"])
            if len(toks) != len(hashes) * bs:
                fail(f"BlockStored with {len(hashes)} blocks carries {len(toks)} tokens")
            for i, h in enumerate(hashes):
                mirror[h] = (parent, toks[i * bs:(i + 1) * bs])
                parent = h
            stats["stored"] += len(hashes)
        elif t == "BlockRemoved":
            for h in ev["block_hashes"]:
                if h not in mirror:
                    fail(f"BlockRemoved for unknown block {h}")
                del mirror[h]
            stats["removed"] += len(ev["block_hashes"])
        elif t == "AllBlocksCleared":
            mirror.clear()
            stats["cleared"] += 1


def main():
    base, pub, replay, model, encoding = sys.argv[1:6]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 500)
    sub.connect(pub)
    time.sleep(0.2)  # let the subscription reach the publisher; missed batches are replayed

    # A workload larger than the cache: distinct 400-token prompts, some sharing a prefix.
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi".split()
    prompts = []
    for i in range(10):
        shared = " ".join(words[(j * 3) % len(words)] for j in range(150))
        own = " ".join(words[(i * 7 + j * 5) % len(words)] + str(i) for j in range(120))
        prompts.append(shared + " " + own)
    for i, p in enumerate(prompts + prompts[:2]):
        # Requests 4 and 5 run with the drop_events fault: their batches consume seqs but are
        # not sent, so the subscriber sees a gap that only the replay socket can fill.
        if i == 4:
            http("POST", f"{base}/admin/faults", {"drop_events": True})
        r = http("POST", f"{base}/v1/completions", {"model": model, "prompt": p, "max_tokens": 20})
        if i == 5:
            http("POST", f"{base}/admin/faults", {"drop_events": False})
        if r["usage"]["completion_tokens"] != 20:
            fail(f"usage {r['usage']}")

    batches = {}
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            topic, seq, payload = sub.recv_multipart()
        except zmq.Again:
            break
        (s,) = struct.unpack(">Q", seq)
        batches[s] = payload
    if not batches:
        fail("no KV-event batch received")
    last = max(batches)
    missing = [s for s in range(last + 1) if s not in batches]
    replayed = 0
    if missing:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(replay)
        dealer.send_multipart([b"", struct.pack(">Q", min(missing))])
        while True:
            frames = dealer.recv_multipart()
            # DEALER sees [b"", (topic,) seq, payload]: drop the empty delimiter only.
            if len(frames) > 2 and frames[0] == b"":
                frames = frames[1:]
            seq_b, payload = frames[-2], frames[-1]
            (s,) = struct.unpack(">q", seq_b)
            if s == -1:
                break
            if s not in batches:
                batches[s] = payload
                replayed += 1
        still = [s for s in range(last + 1) if s not in batches]
        if still:
            fail(f"batches {still[:10]} neither received nor replayed")

    mirror, stats = {}, {"stored": 0, "removed": 0, "cleared": 0}
    for s in sorted(batches):
        batch = msgpack.unpackb(batches[s], raw=False, strict_map_key=False)
        if not (isinstance(batch, list) and len(batch) == 3):
            fail(f"batch {s} is not [ts, events, dp_rank]")
        ts, events, _rank = batch
        if not isinstance(ts, float):
            fail("ts is not a float")
        apply(mirror, [decode_event(e, encoding) for e in events], stats)

    cache = http("GET", f"{base}/admin/kv_cache")["blocks"]
    engine = {b["hash"]: (b["parent"], b["token_ids"]) for b in cache}
    if set(engine) != set(mirror):
        fail(f"mirror has {len(mirror)} blocks, engine {len(engine)}; "
             f"only in mirror {list(set(mirror) - set(engine))[:5]}, "
             f"only in engine {list(set(engine) - set(mirror))[:5]}")
    for h, (parent, toks) in engine.items():
        if mirror[h] != (parent, toks):
            fail(f"block {h}: mirror {mirror[h]} != engine {(parent, toks)}")
    if replayed == 0:
        fail("the drop_events fault produced no gap for the replay socket to fill")
    if stats["removed"] == 0:
        fail("a workload larger than the cache produced no BlockRemoved")

    # The token ids of the chain ending at the last prompt reproduce its tokens.
    toks = http("POST", f"{base}/tokenize", {"model": model, "prompt": prompts[1]})["tokens"]
    by_tokens = {}
    for h, (parent, t) in mirror.items():
        by_tokens[(parent, tuple(t))] = h
    parent, n, bs = None, 0, len(next(iter(mirror.values()))[1])
    while (n + 1) * bs <= len(toks) - 1:
        h = by_tokens.get((parent, tuple(toks[n * bs:(n + 1) * bs])))
        if h is None:
            break
        parent, n = h, n + 1
    if n < (len(toks) - 1) // bs:
        fail(f"only {n} of {(len(toks) - 1) // bs} blocks of the last prompt found by token chain")
    print(json.dumps({"ok": True, "batches": len(batches), "replayed": replayed,
                      "blocks": len(mirror), **stats, "chain_blocks": n}))


if __name__ == "__main__":
    main()
