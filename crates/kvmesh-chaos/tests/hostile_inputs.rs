//! The bounded CI version of the fuzz targets (fuzz/): the mesh envelope decoder, the
//! KV-event decoder and the OpenAI request parser on seeded random bytes and on mutations
//! (bit flips, truncations, splices, byte runs) of valid inputs — a fixed count each, no
//! panic; plus every file of the committed fuzz corpus (fuzz/corpus/<target>/) when present.
//! The same checks as the fuzz targets: what decodes re-encodes to the same thing; a KV batch
//! stays within the limits.

use kvmesh_kvevents::{
    BlockHash, DecodeLimits, EventBatch, KvEvent, WireEncoding, decode_batch, decode_frame,
    encode_batch,
};
use kvmesh_openai::{ChatCompletionRequest, CompletionRequest, parse_body};
use kvmesh_state::wire::{self, Envelope, EnvelopeV1};
use std::path::PathBuf;

const CLUSTER: u64 = 0x6b76_6d65_7368;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(seed: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        match rng.below(5) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 => v.truncate(rng.below(v.len() + 1)),
            2 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = [0x00, 0xff, 0x7f, 0x80, 0xdc, 0xdd, 0xc1][rng.below(7)];
            }
            3 => {
                let i = rng.below(v.len() + 1);
                let run = vec![rng.next() as u8; rng.below(64)];
                v.splice(i..i, run);
            }
            _ => {
                let i = rng.below(v.len() + 1);
                let j = rng.below(v.len() + 1);
                let (a, b) = (i.min(j), i.max(j));
                let copy = v[a..b].to_vec();
                v.extend_from_slice(&copy);
            }
        }
    }
    v
}

fn random(rng: &mut Rng) -> Vec<u8> {
    (0..rng.below(512)).map(|_| rng.next() as u8).collect()
}

fn envelope(data: &[u8]) {
    if let Ok(env) = wire::decode(data, CLUSTER) {
        let again = wire::encode(&Envelope::V1(env.clone())).expect("a decoded envelope encodes");
        assert_eq!(wire::decode(&again, CLUSTER).expect("round trip"), env);
    }
}

fn kv_events(data: &[u8]) {
    let limits = DecodeLimits::default();
    if let Ok(b) = decode_batch(data, &limits) {
        assert!(b.batch.events.len() <= limits.max_events_per_batch);
    }
    if data.len() >= 2 {
        let (a, rest) = data.split_at((data[0] as usize).min(data.len() - 1));
        let (s, p) = rest.split_at(rest.len().min(8));
        let _ = decode_frame(&[a, s, p], &limits);
    }
}

fn openai(data: &[u8]) {
    if let Ok(r) = parse_body::<ChatCompletionRequest>(data) {
        let _ = r.validate();
    }
    if let Ok(r) = parse_body::<CompletionRequest>(data) {
        let _ = r.validate();
    }
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read(e.path()).ok())
                .collect()
        })
        .unwrap_or_default()
}

fn run(target: &str, seeds: Vec<Vec<u8>>, check: fn(&[u8]), count: usize) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ target.len() as u64);
    let replayed = corpus(target);
    for c in &replayed {
        check(c);
    }
    let pool: Vec<Vec<u8>> = seeds.into_iter().chain(replayed).collect();
    for k in 0..count {
        let input = if k % 4 == 0 || pool.is_empty() {
            random(&mut rng)
        } else {
            mutate(&pool[rng.below(pool.len())], &mut rng)
        };
        check(&input);
    }
}

#[test]
fn mesh_envelope_decoder_survives_hostile_bytes() {
    let env = EnvelopeV1 {
        cluster_id: CLUSTER,
        from: kvmesh_state::NodeId(7),
        kind: kvmesh_state::EnvelopeKind::Live,
        sent_us: 1_700_000_000_000_000,
        deltas: vec![],
        control: vec![],
    };
    let seed = wire::encode(&Envelope::V1(env)).unwrap();
    envelope(&seed);
    run("mesh_envelope", vec![seed], envelope, 100_000);
}

#[test]
fn kv_event_decoder_survives_hostile_bytes() {
    let batch = EventBatch {
        ts: 1.5,
        events: vec![
            KvEvent::BlockStored {
                block_hashes: vec![BlockHash::Int(1), BlockHash::Bytes(vec![9; 32])],
                parent_block_hash: None,
                token_ids: (0..32).collect(),
                block_size: 16,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
                extra_keys: None,
                group_idx: None,
                kv_cache_spec_kind: None,
                kv_cache_spec_sliding_window: None,
                locality: None,
                ownership: None,
            },
            KvEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(0),
    };
    let seeds = vec![
        encode_batch(&batch, WireEncoding::Array),
        encode_batch(&batch, WireEncoding::Map),
    ];
    for s in &seeds {
        assert!(decode_batch(s, &DecodeLimits::default()).is_ok());
    }
    run("kv_events", seeds, kv_events, 100_000);
}

#[test]
fn openai_request_parser_survives_hostile_bytes() {
    let seeds: Vec<Vec<u8>> = [
        r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_tokens":4,"stream":true,"stream_options":{"include_usage":true},"temperature":0.5,"stop":["x"],"n":1}"#,
        r#"{"model":"m","prompt":["a","b"],"max_tokens":2,"logprobs":1,"echo":false,"user":"u"}"#,
        r#"{"model":"m","prompt":[[1,2,3]],"max_tokens":1}"#,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    assert!(parse_body::<ChatCompletionRequest>(&seeds[0]).is_ok());
    run("openai_request", seeds, openai, 100_000);
}
