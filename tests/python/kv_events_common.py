"""Shared helpers for the kv_events_*.py interop scripts.

Converts between the canonical JSON form of a KV-event batch (see
crates/kvmesh-kvevents/src/json.rs) and the msgpack object trees vLLM's
msgspec encoder produces (vllm/distributed/kv_events.py), written here
independently of the Rust code:

* batch envelope: always ``[ts, events, data_parallel_rank]`` (EventBatch is
  ``array_like=True``; ``omit_defaults`` never shortens an array_like struct)
* array events (``array_like=True``, vLLM <= 0.23): ``[tag, field...]`` with
  every declared field, None as nil
* map events (vLLM PR #42892): ``{"type": tag, field: value...}``; fields
  without a default always present, defaulted fields only when not None

JSON conventions: byte strings are ``{"$bytes": hex}``, msgpack maps inside
extra_keys are ``{"$map": [[k, v], ...]}``, ext values ``{"$ext": [type, hex]}``.
"""

STORED_FIELDS = [
    # (name, has_default_in_vllm)
    ("block_hashes", False),
    ("parent_block_hash", False),
    ("token_ids", False),
    ("block_size", False),
    ("lora_id", False),
    ("medium", False),
    ("lora_name", False),
    ("extra_keys", True),
    ("group_idx", True),
    ("kv_cache_spec_kind", True),
    ("kv_cache_spec_sliding_window", True),
]
# Map-only fields (added after events stopped being positional).
STORED_MAP_EXTRA = ["locality", "ownership"]
REMOVED_FIELDS = [("block_hashes", False), ("medium", False), ("group_idx", True)]
REMOVED_MAP_EXTRA = ["locality", "ownership"]


def _unhex(h):
    return bytes.fromhex(h)


def json_to_obj(v):
    """Canonical JSON value -> Python object msgpack encodes as vLLM would."""
    if isinstance(v, dict):
        if "$bytes" in v:
            return _unhex(v["$bytes"])
        if "$map" in v:
            out = {}
            for k, val in v["$map"]:
                k = json_to_obj(k)
                if isinstance(k, list):
                    k = tuple(k)
                out[k] = json_to_obj(val)
            return out
        if "$ext" in v:
            import msgpack

            ty, data = v["$ext"]
            return msgpack.ExtType(ty, _unhex(data))
        return {k: json_to_obj(val) for k, val in v.items()}
    if isinstance(v, list):
        return [json_to_obj(x) for x in v]
    return v


def obj_to_json(v):
    """Python object decoded by msgpack (raw=False) -> canonical JSON value."""
    import msgpack

    if isinstance(v, (bytes, bytearray)):
        return {"$bytes": bytes(v).hex()}
    if isinstance(v, dict):
        return {"$map": [[obj_to_json(k), obj_to_json(val)] for k, val in v.items()]}
    if isinstance(v, (list, tuple)):
        return [obj_to_json(x) for x in v]
    if isinstance(v, msgpack.ExtType):
        return {"$ext": [v.code, v.data.hex()]}
    return v


def _hash_to_json(h):
    if isinstance(h, (bytes, bytearray)):
        return {"$bytes": bytes(h).hex()}
    if isinstance(h, int) and h < 0:
        return h + (1 << 64)  # signed producers: two's complement
    return h


def event_to_obj(ev, encoding, array_fields=None):
    """Canonical JSON event -> msgpack object tree (``array``/``map``).

    ``array_fields`` truncates positional events to that many fields after the
    tag (older vLLM layouts)."""
    tag = ev["type"]
    if tag == "BlockStored":
        fields, extra = STORED_FIELDS, STORED_MAP_EXTRA
    elif tag == "BlockRemoved":
        fields, extra = REMOVED_FIELDS, REMOVED_MAP_EXTRA
    elif tag == "AllBlocksCleared":
        fields, extra = [], []
    else:  # unknown tag: pass through whatever fields are given
        if encoding == "array":
            return [tag] + [json_to_obj(v) for k, v in ev.items() if k != "type"]
        return {k: json_to_obj(v) for k, v in ev.items()}
    if encoding == "array":
        out = [tag] + [json_to_obj(ev.get(name)) for name, _ in fields]
        if array_fields is not None:
            out = out[: 1 + array_fields]
        return out
    out = {"type": tag}
    for name, has_default in fields:
        val = ev.get(name)
        if has_default and val is None:
            continue
        out[name] = json_to_obj(val)
    for name in extra:
        if ev.get(name) is not None:
            out[name] = json_to_obj(ev[name])
    return out


def batch_to_obj(batch, encoding, array_fields=None, batch_fields=3):
    events = [event_to_obj(e, encoding, array_fields) for e in batch["events"]]
    out = [float(batch["ts"]), events, batch.get("data_parallel_rank")]
    return out[:batch_fields]


def pack(obj):
    import msgpack

    return msgpack.packb(obj, use_bin_type=True)


def encode_batch(batch, encoding, **kw):
    return pack(batch_to_obj(batch, encoding, **kw))


def _event_from_obj(ev):
    """Decoded msgpack event (list or dict) -> canonical JSON (or None if unknown)."""
    if isinstance(ev, list):
        tag, values = ev[0], ev[1:]
        if tag == "BlockStored":
            names = [n for n, _ in STORED_FIELDS]
        elif tag == "BlockRemoved":
            names = [n for n, _ in REMOVED_FIELDS]
        elif tag == "AllBlocksCleared":
            names = []
        else:
            return None
        d = {"type": tag}
        d.update(dict(zip(names, values)))
    elif isinstance(ev, dict):
        d = dict(ev)
        tag = d.get("type")
        if tag not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            return None
    else:
        raise ValueError(f"event is neither array nor map: {ev!r}")
    if tag == "AllBlocksCleared":
        return {"type": tag}
    names = [n for n, _ in (STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS)]
    names += STORED_MAP_EXTRA if tag == "BlockStored" else REMOVED_MAP_EXTRA
    out = {"type": tag}
    for name in names:
        val = d.get(name)
        if name == "block_hashes":
            val = [_hash_to_json(h) for h in val]
        elif name == "parent_block_hash":
            val = None if val is None else _hash_to_json(val)
        elif name == "extra_keys":
            val = None if val is None else [obj_to_json(x) for x in val]
        out[name] = val
    return out


def batch_from_payload(payload):
    """msgpack payload -> (canonical JSON batch, encoding, skipped_unknown)."""
    import msgpack

    obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(obj, dict):
        ts, events, rank = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    else:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    encodings = {"array" if isinstance(e, list) else "map" for e in events}
    out, skipped = [], 0
    for e in events:
        j = _event_from_obj(e)
        if j is None:
            skipped += 1
        else:
            out.append(j)
    enc = encodings.pop() if len(encodings) == 1 else ("mixed" if encodings else None)
    return {"ts": ts, "events": out, "data_parallel_rank": rank}, enc, skipped
