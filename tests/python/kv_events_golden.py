#!/usr/bin/env python3
"""Encodes canonical-JSON KV-event batches the way vLLM does, for golden tests.

Reads from stdin a JSON list of cases {"batch": <canonical batch JSON>,
"encoding": "array"|"map"} and prints one JSON object:
  {"msgpack": [hex...],            # plain msgpack with vLLM's layouts
   "msgspec": [hex...] | null,     # vLLM's msgspec structs, if msgspec is installed
   "msgspec_version": str | null}
The msgspec structs below copy the struct options and field order of
vllm/distributed/kv_events.py: EventBatch array_like=True, omit_defaults=True;
KVCacheEvent tag=True, omit_defaults=True, array_like=True for the "array"
encoding (vLLM <= 0.23) and without array_like for "map" (vLLM PR #42892;
map-only fields locality/ownership and event_version=1 as on vLLM main).
"""
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_events_common as common  # noqa: E402

try:
    import msgpack  # noqa: F401
except ImportError:  # pragma: no cover
    print("msgpack missing: run scripts/install-test-deps.sh", file=sys.stderr)
    sys.exit(3)


def msgspec_structs(array_like):
    import msgspec

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True,
                       gc=False, tag=True):
        pass

    if array_like:
        class BlockStored(KVCacheEvent):
            block_hashes: list[bytes | int]
            parent_block_hash: bytes | int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list[Any] | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[bytes | int]
            medium: str | None
            group_idx: int | None = None
    else:
        class BlockStored(KVCacheEvent):
            block_hashes: list[bytes | int]
            parent_block_hash: bytes | int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            event_version: int = 1
            extra_keys: list[Any] | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None
            locality: str | None = None
            ownership: str | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[bytes | int]
            medium: str | None
            group_idx: int | None = None
            locality: str | None = None
            ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def msgspec_encode(batch, encoding):
    import msgspec

    EventBatch, Stored, Removed, Cleared = msgspec_structs(encoding == "array")
    events = []
    for ev in batch["events"]:
        fields = {k: common.json_to_obj(v) for k, v in ev.items() if k != "type"}
        if ev["type"] == "BlockStored":
            allowed = Stored.__struct_fields__
            events.append(Stored(**{k: v for k, v in fields.items() if k in allowed}))
        elif ev["type"] == "BlockRemoved":
            allowed = Removed.__struct_fields__
            events.append(Removed(**{k: v for k, v in fields.items() if k in allowed}))
        else:
            events.append(Cleared())
    b = EventBatch(ts=float(batch["ts"]), events=events,
                   data_parallel_rank=batch.get("data_parallel_rank"))
    return msgspec.msgpack.encode(b)


def main():
    cases = json.load(sys.stdin)
    out = {"msgpack": [common.encode_batch(c["batch"], c["encoding"]).hex() for c in cases]}
    try:
        import msgspec
    except ImportError:
        out["msgspec"] = None
        out["msgspec_version"] = None
    else:
        out["msgspec"] = [msgspec_encode(c["batch"], c["encoding"]).hex() for c in cases]
        out["msgspec_version"] = msgspec.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
