//! Timing: prefill cost and cache hits, decode interference, slowdown, the instant profile and
//! the virtual-time driver.

use kvmesh_engine::{
    BatchShape, DuplicateBlocks, Engine, EngineParams, RequestSpec, TimingProfile, drive,
};

fn h100() -> EngineParams {
    EngineParams {
        seed: 3,
        duplicate_blocks: DuplicateBlocks::Keep,
        ..EngineParams::default()
    }
}

fn prompt(seed: u32, n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| (i * 7919 + seed * 104_729) % 151_000)
        .collect()
}

#[test]
fn cached_prompt_cuts_ttft_by_the_prefill_cost_of_its_hit_tokens() {
    let p = h100();
    let prof = p.profile.clone();
    let mut e = Engine::new(p);
    let r1 = drive::run(&mut e, [(0, RequestSpec::new(1, prompt(1, 2000), 1))]);
    let t = r1.end + 1_000_000;
    let r2 = drive::run(&mut e, [(t, RequestSpec::new(2, prompt(1, 2000), 1))]);
    let (f1, f2) = (&r1.finished[0], &r2.finished[0]);
    let ttft1 = f1.first_token_at - f1.arrival;
    let ttft2 = f2.first_token_at - f2.arrival;
    assert_eq!(f2.cached_tokens, 1984);
    // Uncached 2,000-token prefill: 80-100 ms; fully cached: a few ms.
    assert!((80_000..=100_000).contains(&ttft1), "ttft1 {ttft1}");
    assert!((2_000..=10_000).contains(&ttft2), "ttft2 {ttft2}");
    // The saving is the profile's prefill cost of the 1,984 hit tokens.
    let hit_cost = prof.prefill_token_us * 1984.0
        + prof.prefill_attention_ns / 1000.0 * (1984.0 * 1984.0 / 2.0 + 16.0 * 1984.0);
    let saved = (ttft1 - ttft2) as f64;
    assert!(
        (saved - hit_cost).abs() / hit_cost < 0.01,
        "saved {saved} vs {hit_cost}"
    );
}

#[test]
fn a_long_uncached_prefill_slows_every_concurrent_decode() {
    let mut e = Engine::new(h100());
    for i in 0..8 {
        e.add_request(RequestSpec::new(i, prompt(i as u32, 500), 200), 0)
            .unwrap();
    }
    let mut now = 0;
    let mut decode_only = Vec::new();
    for _ in 0..20 {
        let o = e.step(now);
        now += o.duration_us;
        if o.shape.prefill_tokens == 0 {
            decode_only.push(o.duration_us);
        }
    }
    let itl = *decode_only.last().unwrap();
    assert!((5_000..=15_000).contains(&itl), "decode step {itl} us");
    e.add_request(RequestSpec::new(99, prompt(99, 16_000), 1), now)
        .unwrap();
    let o = e.step(now);
    assert_eq!(o.shape.decode_seqs, 8);
    assert_eq!(o.shape.prefill_tokens, 8192 - 8);
    // The 8 decodes of this step wait for the prefill chunk: their inter-token latency jumps.
    assert!(o.duration_us > 20 * itl, "{} vs {itl}", o.duration_us);
    assert_eq!(o.tokens.len(), 8);
}

#[test]
fn slowdown_multiplies_durations() {
    let mk = |f: f64| {
        let mut e = Engine::new(h100());
        e.set_slowdown(f);
        e.set_slowdown(f64::NAN); // ignored
        e.add_request(RequestSpec::new(1, prompt(1, 1000), 1), 0)
            .unwrap();
        e.step(0).duration_us
    };
    let base = mk(1.0);
    assert!(base > 0);
    assert!((mk(3.0) as i64 - 3 * base as i64).abs() <= 2);
}

#[test]
fn instant_profile_is_free_and_still_completes() {
    let mut p = h100();
    p.profile = TimingProfile::by_name("instant").unwrap();
    let mut e = Engine::new(p);
    let work: Vec<_> = (0..50)
        .map(|i| (i * 100, RequestSpec::new(i, prompt(i as u32 % 5, 300), 10)))
        .collect();
    let mut steps = 0;
    let r = drive::run_with(&mut e, work, |_, o| {
        steps += 1;
        assert_eq!(o.duration_us, 0);
    });
    assert_eq!(r.finished.len(), 50);
    assert!(r.finished.iter().all(|f| f.first_token_at == f.arrival));
    assert_eq!(r.end, 4900);
    assert!(steps > 0);
}

#[test]
fn driver_time_is_steps_plus_idle_gaps() {
    let mut e = Engine::new(h100());
    let work = vec![
        (0, RequestSpec::new(1, prompt(1, 100), 3)),
        (10_000_000, RequestSpec::new(2, prompt(2, 100), 3)),
    ];
    let mut busy = 0;
    let r = drive::run_with(&mut e, work, |_, o| busy += o.duration_us);
    let f2 = r.finished.iter().find(|f| f.id == 2).unwrap();
    assert_eq!(f2.arrival, 10_000_000);
    assert_eq!(r.end, f2.finished_at);
    let first = r.finished.iter().find(|f| f.id == 1).unwrap().finished_at;
    assert_eq!(busy, first + (r.end - 10_000_000));
}

#[test]
fn profiles_give_plausible_orders_of_magnitude() {
    for name in TimingProfile::names() {
        let p = TimingProfile::by_name(name).unwrap();
        let prefill = BatchShape {
            prefill_tokens: 2000,
            prefill_attention_pairs: 2000 * 1000,
            ..Default::default()
        };
        let decode = BatchShape {
            decode_seqs: 64,
            decode_context_tokens: 64 * 1500,
            ..Default::default()
        };
        let (pf, dc) = (p.step_micros(&prefill), p.step_micros(&decode));
        match *name {
            "instant" => assert_eq!((pf, dc), (0.0, 0.0)),
            "h100-8b" => {
                assert!((80_000.0..100_000.0).contains(&pf), "{pf}");
                assert!((6_000.0..15_000.0).contains(&dc), "{dc}");
            }
            _ => {
                // Slower hardware or a bigger model: slower than h100-8b.
                let h = TimingProfile::default();
                assert!(pf > h.step_micros(&prefill) && dc > h.step_micros(&decode));
            }
        }
    }
}
