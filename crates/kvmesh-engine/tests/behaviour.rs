//! Targeted tests of vLLM behaviours: hit accounting, LRU order, duplicates, chunked prefill,
//! FCFS admission, preemption, events, resets, admission errors.

mod common;

use kvmesh_engine::{
    AdmitError, DuplicateBlocks, Engine, EngineEvent, EngineParams, RequestSpec, StepOutput,
    TimingProfile, drive,
};

fn params(block_size: u32, num_blocks: u32) -> EngineParams {
    EngineParams {
        block_size,
        num_blocks,
        max_num_seqs: 16,
        max_num_batched_tokens: 8192,
        enable_prefix_caching: true,
        max_model_len: 100_000,
        profile: TimingProfile::by_name("h100-8b").unwrap(),
        seed: 42,
        output_vocab: vec![],
        duplicate_blocks: DuplicateBlocks::Keep,
    }
}

fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

/// Runs one request alone to completion; returns all step outputs.
fn run_one(e: &mut Engine, spec: RequestSpec, now: &mut u64) -> Vec<StepOutput> {
    e.add_request(spec, *now).unwrap();
    let mut outs = Vec::new();
    while e.has_work() {
        let o = e.step(*now);
        *now += o.duration_us;
        e.check_invariants().unwrap();
        outs.push(o);
    }
    outs
}

fn finished(outs: &[StepOutput]) -> kvmesh_engine::FinishedRequest {
    outs.iter().flat_map(|o| o.finished.clone()).next().unwrap()
}

fn events(outs: &[StepOutput]) -> Vec<EngineEvent> {
    outs.iter().flat_map(|o| o.events.clone()).collect()
}

fn removed(ev: &[EngineEvent]) -> Vec<u64> {
    ev.iter()
        .filter_map(|e| match e {
            EngineEvent::BlockRemoved { block_hashes } => Some(block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

#[test]
fn hits_are_full_blocks_and_never_the_last_prompt_token() {
    let mut e = Engine::new(params(16, 100));
    let mut now = 0;
    // 48 tokens = 3 full blocks: the repeat may hit at most 47 tokens -> 2 blocks = 32.
    let f = finished(&run_one(
        &mut e,
        RequestSpec::new(1, toks(0, 48), 1),
        &mut now,
    ));
    assert_eq!(f.cached_tokens, 0);
    let f = finished(&run_one(
        &mut e,
        RequestSpec::new(2, toks(0, 48), 1),
        &mut now,
    ));
    assert_eq!(f.cached_tokens, 32);
    // 50 tokens extending it: 3 blocks hit = 48.
    let f = finished(&run_one(
        &mut e,
        RequestSpec::new(3, toks(0, 50), 1),
        &mut now,
    ));
    assert_eq!(f.cached_tokens, 48);
    // Diverging in block 2: 2 blocks.
    let mut p = toks(0, 50);
    p[40] = 999;
    let f = finished(&run_one(&mut e, RequestSpec::new(4, p, 1), &mut now));
    assert_eq!(f.cached_tokens, 32);
    let s = e.stats();
    assert_eq!(s.prefix_cache_queries, 48 + 48 + 50 + 50);
    assert_eq!(s.prefix_cache_hits, 32 + 48 + 32);
}

#[test]
fn lru_evicts_least_recently_freed_first_and_a_request_tail_before_its_head() {
    // 8 blocks of 4 tokens.
    let mut e = Engine::new(params(4, 8));
    let mut now = 0;
    let a = toks(100, 8);
    let b = toks(200, 8);
    let ha = e.block_hashes(&a, None, None);
    let hb = e.block_hashes(&b, None, None);
    run_one(&mut e, RequestSpec::new(1, a.clone(), 1), &mut now); // A: 2 cached blocks
    run_one(&mut e, RequestSpec::new(2, b.clone(), 1), &mut now); // B: 2 cached blocks
    // Touch A again (a hit on its first block): A's first block becomes most recently used.
    let f = finished(&run_one(
        &mut e,
        RequestSpec::new(3, a[..5].to_vec(), 1),
        &mut now,
    ));
    assert_eq!(f.cached_tokens, 4);
    // A request needing all 8 blocks evicts in LRU order: A's tail (freed first), then B's
    // tail and head (freed next, tail first), then A's head (freed last).
    let outs = run_one(&mut e, RequestSpec::new(4, toks(300, 32), 1), &mut now);
    assert_eq!(removed(&events(&outs)), vec![ha[1], hb[1], hb[0], ha[0]]);
}

#[test]
fn blocks_without_hash_are_reused_before_cached_ones() {
    let mut e = Engine::new(params(4, 4));
    let mut now = 0;
    // 6 tokens: one full (cached) block and one partial block.
    run_one(&mut e, RequestSpec::new(1, toks(0, 6), 1), &mut now);
    // 3 tokens need one block: the partial one is reused, nothing is evicted.
    let outs = run_one(&mut e, RequestSpec::new(2, toks(50, 3), 1), &mut now);
    assert!(removed(&events(&outs)).is_empty());
    assert_eq!(e.stats().cached_blocks, 1);
}

#[test]
fn repeated_block_aligned_prompt_duplicates_its_last_block_like_vllm() {
    for mode in [DuplicateBlocks::Keep, DuplicateBlocks::Share] {
        let mut p = params(4, 16);
        p.duplicate_blocks = mode;
        let mut e = Engine::new(p);
        let mut now = 0;
        let prompt = toks(0, 8);
        let h = e.block_hashes(&prompt, None, None);
        run_one(&mut e, RequestSpec::new(1, prompt.clone(), 1), &mut now);
        // Hold the second request mid-flight (2 output tokens) and look at the cache.
        e.add_request(RequestSpec::new(2, prompt.clone(), 3), now)
            .unwrap();
        let o = e.step(now);
        let stored: Vec<u64> = o
            .events
            .iter()
            .flat_map(|ev| match ev {
                EngineEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
                _ => vec![],
            })
            .collect();
        let copies = e.cached_blocks().iter().filter(|b| b.hash == h[1]).count();
        match mode {
            // vLLM: block 1 is recomputed into a new block and cached again.
            DuplicateBlocks::Keep => {
                assert_eq!(stored, vec![h[1]]);
                assert_eq!(copies, 2);
            }
            DuplicateBlocks::Share => {
                assert!(stored.is_empty());
                assert_eq!(copies, 1);
            }
        }
        e.check_invariants().unwrap();
        // The first-inserted copy keeps serving hits; a third request still hits 1 block.
        while e.has_work() {
            now += e.step(now).duration_us;
        }
        let f = finished(&run_one(
            &mut e,
            RequestSpec::new(3, toks(0, 9), 1),
            &mut now,
        ));
        assert_eq!(f.cached_tokens, 8);
    }
}

#[test]
fn same_step_siblings_share_blocks_cached_at_scheduling_time() {
    let mut e = Engine::new(params(16, 100));
    let p = toks(0, 100);
    e.add_request(RequestSpec::new(1, p.clone(), 2), 0).unwrap();
    e.add_request(RequestSpec::new(2, p.clone(), 2), 0).unwrap();
    let o = e.step(0);
    // Both admitted in one step; the second hits the 6 blocks the first just cached.
    assert_eq!(o.shape.prefill_tokens, 100 + 4);
    let mut now = o.duration_us;
    let mut fin = Vec::new();
    while e.has_work() {
        let o = e.step(now);
        now += o.duration_us;
        fin.extend(o.finished);
    }
    fin.sort_by_key(|f| f.id);
    assert_eq!(fin[0].cached_tokens, 0);
    assert_eq!(fin[1].cached_tokens, 96);
}

#[test]
fn chunked_prefill_respects_the_budget_and_decodes_go_first() {
    let mut p = params(4, 200);
    p.max_num_batched_tokens = 32;
    let mut e = Engine::new(p);
    e.add_request(RequestSpec::new(1, toks(0, 10), 20), 0)
        .unwrap();
    let mut now = e.step(0).duration_us; // request 1 prefilled, first token out
    e.add_request(RequestSpec::new(2, toks(1000, 100), 1), now)
        .unwrap();
    let mut chunks = Vec::new();
    let mut first_token_step = None;
    for i in 0..5 {
        let o = e.step(now);
        now += o.duration_us;
        // The decode of request 1 is scheduled first, every step.
        assert_eq!(o.shape.decode_seqs, 1);
        chunks.push(o.shape.prefill_tokens);
        if first_token_step.is_none() && o.tokens.iter().any(|t| t.id == 2) {
            first_token_step = Some(i);
        }
    }
    assert_eq!(chunks, vec![31, 31, 31, 7, 0]);
    assert_eq!(first_token_step, Some(3));
}

#[test]
fn fcfs_a_waiting_request_that_does_not_fit_blocks_later_ones() {
    let mut p = params(4, 10);
    p.max_num_batched_tokens = 1000;
    let mut e = Engine::new(p);
    e.add_request(RequestSpec::new(1, toks(0, 24), 8), 0)
        .unwrap(); // 6 blocks
    let mut now = e.step(0).duration_us;
    e.add_request(RequestSpec::new(2, toks(100, 20), 1), now)
        .unwrap(); // 5 blocks: no room
    e.add_request(RequestSpec::new(3, toks(200, 3), 1), now)
        .unwrap(); // 1 block: would fit
    let o = e.step(now);
    now += o.duration_us;
    assert_eq!(
        o.shape.prefill_tokens, 0,
        "nothing admitted past the blocked head"
    );
    assert_eq!(e.stats().waiting, 2);
    let mut order = Vec::new();
    while e.has_work() {
        let o = e.step(now);
        now += o.duration_us;
        order.extend(o.finished.iter().map(|f| f.id));
    }
    assert_eq!(order, vec![1, 2, 3]);
}

#[test]
fn max_num_seqs_caps_the_running_set() {
    let mut p = params(16, 1000);
    p.max_num_seqs = 3;
    let mut e = Engine::new(p);
    for i in 0..10 {
        e.add_request(RequestSpec::new(i, toks(i as u32 * 100, 20), 5), 0)
            .unwrap();
    }
    let mut now = 0;
    while e.has_work() {
        let o = e.step(now);
        now += o.duration_us;
        assert!(e.stats().running <= 3);
        assert!(o.shape.decode_seqs + (o.shape.prefill_tokens > 0) as u64 <= 3 + 3);
    }
    assert_eq!(e.stats().finished_requests, 10);
}

#[test]
fn out_of_blocks_preempts_the_newest_which_resumes_and_finishes() {
    // 12 blocks of 4 = 48 token slots; two requests growing to 4 + 30 tokens each cannot both
    // fit.
    let mut p = params(4, 12);
    p.max_num_batched_tokens = 64;
    let mut e = Engine::new(p);
    e.add_request(RequestSpec::new(1, toks(0, 4), 30), 0)
        .unwrap();
    e.add_request(RequestSpec::new(2, toks(100, 4), 30), 0)
        .unwrap();
    let mut now = 0;
    let mut fin = Vec::new();
    let mut tokens = std::collections::BTreeMap::<u64, Vec<u32>>::new();
    let mut saw_preemption_step = false;
    while e.has_work() {
        let before = e.stats().preemptions;
        let o = e.step(now);
        now += o.duration_us;
        e.check_invariants().unwrap();
        if e.stats().preemptions > before {
            saw_preemption_step = true;
            // The victim is the newest (request 2), back in the waiting queue; nothing new is
            // admitted in a step that preempted.
            assert_eq!(e.stats().waiting, 1);
            assert!(!o.tokens.iter().any(|t| t.id == 2));
        }
        for t in &o.tokens {
            let v = tokens.entry(t.id).or_default();
            assert_eq!(t.index as usize, v.len());
            v.push(t.token);
        }
        fin.extend(o.finished);
    }
    assert!(saw_preemption_step);
    fin.sort_by_key(|f| f.id);
    assert_eq!(fin.len(), 2);
    assert_eq!(fin[0].preemptions, 0);
    assert!(fin[1].preemptions >= 1);
    assert_eq!(fin[1].output_tokens, 30);
    assert_eq!(tokens[&2].len(), 30);
    let s = e.stats();
    assert_eq!(s.preemptions, fin[1].preemptions as u64);
    // The rescheduled lookups are counted apart, as vLLM does.
    assert!(s.preempted_prefix_cache_queries > 0);
    assert_eq!(s.prefix_cache_queries, 8);
}

#[test]
fn generated_tokens_fill_blocks_that_a_next_turn_hits() {
    let mut e = Engine::new(params(4, 100));
    let mut now = 0;
    let prompt = toks(0, 6);
    let outs = run_one(&mut e, RequestSpec::new(1, prompt.clone(), 11), &mut now);
    let reply: Vec<u32> = outs
        .iter()
        .flat_map(|o| o.tokens.iter().map(|t| t.token))
        .collect();
    // 6 + 11 = 17 tokens, the last never fed: 16 computed -> 4 full blocks cached.
    let ev = events(&outs);
    let stored: Vec<&EngineEvent> = ev
        .iter()
        .filter(|e| matches!(e, EngineEvent::BlockStored { .. }))
        .collect();
    assert_eq!(e.stats().cached_blocks, 4);
    // Decode-time blocks are stored one per event, chained to their parent.
    let all: Vec<u32> = prompt
        .iter()
        .copied()
        .chain(reply.iter().copied())
        .collect();
    let h = e.block_hashes(&all, None, None);
    assert_eq!(h.len(), 4);
    let last = stored.last().unwrap();
    match last {
        EngineEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            ..
        } => {
            assert_eq!(block_hashes, &vec![h[3]]);
            assert_eq!(*parent_block_hash, Some(h[2]));
            assert_eq!(token_ids, &all[12..16].to_vec());
        }
        _ => unreachable!(),
    }
    // The next turn (conversation so far + a question) hits all 4 blocks.
    let mut turn2 = all.clone();
    turn2.extend([900, 901, 902]);
    let f = finished(&run_one(&mut e, RequestSpec::new(2, turn2, 1), &mut now));
    assert_eq!(f.cached_tokens, 16);
}

#[test]
fn block_stored_groups_a_chunk_with_its_parent() {
    let mut p = params(4, 100);
    p.max_num_batched_tokens = 10;
    let mut e = Engine::new(p);
    let prompt = toks(0, 21);
    let h = e.block_hashes(&prompt, None, None);
    let outs = run_one(
        &mut e,
        RequestSpec::new(1, prompt.clone(), 1),
        &mut now_zero(),
    );
    let stored: Vec<(Vec<u64>, Option<u64>, Vec<u32>)> = events(&outs)
        .into_iter()
        .filter_map(|e| match e {
            EngineEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            } => Some((block_hashes, parent_block_hash, token_ids)),
            _ => None,
        })
        .collect();
    // Chunks of 10, 10, 1 tokens: full blocks 0-1, then 2-4, then none.
    assert_eq!(
        stored,
        vec![
            (vec![h[0], h[1]], None, prompt[0..8].to_vec()),
            (vec![h[2], h[3], h[4]], Some(h[1]), prompt[8..20].to_vec()),
        ]
    );
}

fn now_zero() -> u64 {
    0
}

#[test]
fn lora_and_salt_isolate_the_cache() {
    let mut e = Engine::new(params(4, 100));
    let mut now = 0;
    let p = toks(0, 13);
    let with = |id, lora: Option<&str>, salt: Option<&str>| RequestSpec {
        id,
        prompt: p.clone(),
        max_tokens: 1,
        lora_name: lora.map(str::to_string),
        cache_salt: salt.map(str::to_string),
    };
    let outs = run_one(&mut e, with(1, Some("a"), None), &mut now);
    assert!(events(&outs).iter().all(|ev| match ev {
        EngineEvent::BlockStored { lora_name, .. } => lora_name.as_deref() == Some("a"),
        _ => true,
    }));
    assert_eq!(
        finished(&run_one(&mut e, with(2, None, None), &mut now)).cached_tokens,
        0
    );
    assert_eq!(
        finished(&run_one(&mut e, with(3, Some("b"), None), &mut now)).cached_tokens,
        0
    );
    assert_eq!(
        finished(&run_one(&mut e, with(4, Some("a"), None), &mut now)).cached_tokens,
        12
    );
    assert_eq!(
        finished(&run_one(&mut e, with(5, None, Some("s"),), &mut now)).cached_tokens,
        0
    );
    assert_eq!(
        finished(&run_one(&mut e, with(6, None, Some("s")), &mut now)).cached_tokens,
        12
    );
}

#[test]
fn admission_errors_change_nothing() {
    let mut p = params(16, 10);
    p.max_model_len = 200;
    let mut e = Engine::new(p);
    e.add_request(RequestSpec::new(1, toks(0, 40), 5), 0)
        .unwrap();
    let o = e.step(0);
    let before = (e.stats(), e.cached_blocks());
    let cases = [
        (RequestSpec::new(1, toks(0, 10), 5), AdmitError::DuplicateId),
        (RequestSpec::new(2, vec![], 5), AdmitError::EmptyPrompt),
        (
            RequestSpec::new(3, toks(0, 10), 0),
            AdmitError::ZeroMaxTokens,
        ),
        (
            RequestSpec::new(4, toks(0, 150), 51),
            AdmitError::TooLong {
                prompt: 150,
                max_tokens: 51,
                max_model_len: 200,
            },
        ),
        (
            RequestSpec::new(5, toks(0, 150), 50),
            AdmitError::ExceedsCache {
                blocks_needed: 13,
                capacity: 10,
            },
        ),
    ];
    for (spec, want) in cases {
        assert_eq!(e.add_request(spec, o.duration_us), Err(want.clone()));
        assert!(!want.to_string().is_empty());
        assert_eq!((e.stats(), e.cached_blocks()), before);
        e.check_invariants().unwrap();
    }
    let msg = AdmitError::TooLong {
        prompt: 150,
        max_tokens: 51,
        max_model_len: 200,
    }
    .to_string();
    assert!(msg.starts_with("This model's maximum context length is 200 tokens. However, you requested 201 tokens (150 in the messages, 51 in the completion)."), "{msg}");
    // Exactly at the limit is fine.
    e.add_request(RequestSpec::new(6, toks(0, 100), 60), 0)
        .unwrap();
}

#[test]
fn abort_frees_blocks_but_keeps_full_ones_cached() {
    let mut e = Engine::new(params(4, 100));
    e.add_request(RequestSpec::new(1, toks(0, 10), 50), 0)
        .unwrap();
    e.add_request(RequestSpec::new(2, toks(0, 10), 50), 0)
        .unwrap();
    e.add_request(RequestSpec::new(3, toks(500, 10), 50), 0)
        .unwrap();
    let mut p = params(4, 100);
    p.max_num_seqs = 2;
    let mut now = e.step(0).duration_us;
    assert!(e.abort(1));
    assert!(!e.abort(1));
    assert!(!e.abort(77));
    e.check_invariants().unwrap();
    assert!(e.stats().cached_blocks >= 2);
    let mut ids = Vec::new();
    while e.has_work() {
        let o = e.step(now);
        now += o.duration_us;
        assert!(o.tokens.iter().all(|t| t.id != 1));
        ids.extend(o.finished.iter().map(|f| f.id));
    }
    ids.sort();
    assert_eq!(ids, vec![2, 3]);
    assert_eq!(e.stats().aborted_requests, 1);
    // A waiting request can be aborted too.
    let mut e = Engine::new(p);
    for i in 0..4 {
        e.add_request(RequestSpec::new(i, toks(0, 10), 5), 0)
            .unwrap();
    }
    e.step(0);
    assert!(e.abort(3));
    assert_eq!(e.stats().waiting, 1);
    e.check_invariants().unwrap();
}

#[test]
fn reset_prefix_cache_only_when_idle() {
    let mut e = Engine::new(params(4, 100));
    let mut now = 0;
    e.add_request(RequestSpec::new(1, toks(0, 10), 5), 0)
        .unwrap();
    let o = e.step(0);
    now += o.duration_us;
    assert!(!e.reset_prefix_cache(), "blocks are in use");
    assert!(e.take_events().is_empty());
    while e.has_work() {
        now += e.step(now).duration_us;
    }
    assert!(e.stats().cached_blocks > 0);
    assert!(e.reset_prefix_cache());
    assert_eq!(e.stats().cached_blocks, 0);
    assert!(e.cached_blocks().is_empty());
    // The event waits for the next step unless taken.
    let o = run_one(&mut e, RequestSpec::new(2, toks(0, 10), 1), &mut now);
    assert_eq!(o[0].events[0], EngineEvent::AllBlocksCleared);
    assert_eq!(finished(&o).cached_tokens, 0);
    assert!(e.reset_prefix_cache());
    assert_eq!(e.take_events(), vec![EngineEvent::AllBlocksCleared]);
    assert!(e.step(now).events.is_empty());
}

#[test]
fn prefix_caching_off_means_no_hits_and_no_events() {
    let mut p = params(4, 100);
    p.enable_prefix_caching = false;
    let mut e = Engine::new(p);
    let work = (0..20)
        .map(|i| (i * 1000, RequestSpec::new(i, toks(0, 30), 3)))
        .collect::<Vec<_>>();
    let mut evs = 0;
    let r = drive::run_with(&mut e, work, |_, o| evs += o.events.len());
    assert_eq!(evs, 0);
    assert_eq!(r.finished.len(), 20);
    assert!(r.finished.iter().all(|f| f.cached_tokens == 0));
    assert_eq!(r.stats.prefix_cache_queries, 0);
    assert_eq!(r.stats.cached_blocks, 0);
    assert_eq!(e.matched_prefix_tokens(&toks(0, 30), None, None), 0);
}

#[test]
fn kv_usage_counts_referenced_blocks_only() {
    let mut e = Engine::new(params(4, 100));
    e.add_request(RequestSpec::new(1, toks(0, 40), 5), 0)
        .unwrap();
    let o = e.step(0);
    let s = e.stats();
    assert_eq!(s.used_blocks, 10);
    assert!((s.kv_cache_usage - 0.10).abs() < 1e-12);
    let mut now = o.duration_us;
    while e.has_work() {
        now += e.step(now).duration_us;
    }
    let s = e.stats();
    assert_eq!(
        (s.used_blocks, s.free_blocks, s.kv_cache_usage),
        (0, 100, 0.0)
    );
    assert_eq!(s.cached_blocks, 11); // 40 prompt + 4 fed outputs = 44 tokens = 11 blocks
}
