//! Replays whose answers are known by hand, through the library API.

use engine::cache_sim::{
    build_policy, page_align_capacity, parse_policies, replay_through_cache, run_sweep,
    ReplayOptions, SweepConfig,
};
use engine::workload::{
    common_prefix, load_mooncake, parse_mooncake, GspConfig, MultiTurnConfig, Request,
};
use engine::{EngineError, ReplayResult};
use radix_cache::policy::BuiltinPolicy;

fn requests(prompts: &[&[u32]]) -> Vec<Request> {
    prompts
        .iter()
        .map(|p| Request {
            tokens: p.to_vec(),
            output_len: 1,
            arrival_s: 0.0,
        })
        .collect()
}

/// A prompt of `len` tokens starting at `first` (disjoint ranges give disjoint prompts).
fn run_of(first: u32, len: u32) -> Vec<u32> {
    (first..first + len).collect()
}

fn run(reqs: &[Request], policy: &str, capacity: usize, page_size: u32) -> ReplayResult {
    let cfg = SweepConfig {
        policies: vec![policy.to_string()],
        capacities: vec![capacity],
        page_size,
        check: true,
        jobs: 1,
        tier: None,
    };
    run_sweep(reqs, &cfg, &|_| {}).unwrap().remove(0)
}

/// The infinite-capacity answer by brute force: each request reuses the longest page-aligned
/// prefix it shares with any earlier request.
fn brute_force_ideal(reqs: &[Request], page_size: usize) -> u64 {
    (0..reqs.len())
        .map(|i| {
            (0..i)
                .map(|j| common_prefix(&reqs[i].tokens, &reqs[j].tokens) / page_size * page_size)
                .max()
                .unwrap_or(0) as u64
        })
        .sum()
}

const HUGE: usize = 1 << 20;

#[test]
fn infinite_capacity_gives_the_hand_computed_full_reuse() {
    let reqs = requests(&[
        &[1, 2, 3, 4, 5, 6],
        &[1, 2, 3, 4, 7, 8], // shares 1 2 3 4
        &[1, 2, 9],          // shares 1 2
        &[1, 2, 3, 4, 5, 6], // all of request 0
        &[10, 11],           // nothing
        &[1, 2, 3, 4, 7],    // 1 2 3 4 7 of request 1 (page size 2: 1 2 3 4)
    ]);
    let prompt_tokens = 6 + 6 + 3 + 6 + 2 + 5;
    for (page_size, expect) in [(1, 4 + 2 + 6 + 5), (2, 4 + 2 + 6 + 4)] {
        for policy in ["lru", "mru", "belady", "cost-aware"] {
            let r = run(&reqs, policy, HUGE, page_size);
            assert_eq!(r.cached_tokens, expect, "{policy} P={page_size}");
            assert_eq!(r.prompt_tokens, prompt_tokens);
            assert_eq!((r.evicted_tokens, r.skipped_requests), (0, 0));
            assert_eq!(r.hit_rate, expect as f64 / prompt_tokens as f64);
        }
        assert_eq!(brute_force_ideal(&reqs, page_size as usize), expect);
        let stats = engine::Workload {
            name: "hand".into(),
            requests: reqs.clone(),
        }
        .stats(page_size);
        assert_eq!(stats.ideal_cached_tokens, expect);
        // The capacity `inf` stands for never evicts.
        let r = run(&reqs, "lru", stats.never_evicting_capacity(), page_size);
        assert_eq!((r.cached_tokens, r.evicted_tokens), (expect, 0));
    }
}

#[test]
fn gsp_infinite_capacity_reuses_every_system_prompt() {
    let small = GspConfig {
        num_groups: 5,
        prompts_per_group: 4,
        system_prompt_len: 100,
        question_len: 10,
        ..GspConfig::default()
    };
    let w = small.generate().unwrap();
    for (page_size, expect) in [(1u32, 5 * 3 * 100), (16, 5 * 3 * 96), (64, 5 * 3 * 64)] {
        let r = run(&w.requests, "lru", HUGE, page_size);
        assert_eq!(r.cached_tokens, expect, "P={page_size}");
        assert_eq!(brute_force_ideal(&w.requests, page_size as usize), expect);
        assert_eq!(w.stats(page_size).ideal_cached_tokens, expect);
    }
    // SGLang's defaults: 64 groups × 15 reuses × 2,048 tokens.
    let w = GspConfig::default().generate().unwrap();
    assert_eq!(w.requests.len(), 1024);
    let r = run(&w.requests, "lru", 4 << 20, 16);
    assert_eq!(r.cached_tokens, 64 * 15 * 2048);
    assert_eq!(r.prompt_tokens, 1024 * (2048 + 128));
}

#[test]
fn multiturn_infinite_capacity_reuses_each_previous_prompt() {
    let cfg = MultiTurnConfig {
        sessions: 4,
        turns: 5,
        input_len: 20,
        output_len: 7,
        ..MultiTurnConfig::default()
    };
    let w = cfg.generate().unwrap();
    // Turn t ≥ 1 reuses turn t − 1's whole prompt: 20 + 27 (t − 1) tokens (floored to pages).
    for page_size in [1usize, 8] {
        let expect: u64 = (1..5)
            .map(|t| ((20 + 27 * (t - 1)) / page_size * page_size) as u64 * 4)
            .sum();
        let r = run(&w.requests, "lru", HUGE, page_size as u32);
        assert_eq!(r.cached_tokens, expect, "P={page_size}");
    }
}

#[test]
fn capacity_of_one_request_gives_no_reuse_between_disjoint_requests() {
    let (a, b) = (run_of(100, 48), run_of(200, 48));
    let reqs = requests(&[&a, &b, &a, &b, &a]);
    for page_size in [1, 16] {
        for policy in parse_policies("all,cost-aware,belady").unwrap() {
            let one = run(&reqs, &policy, 48, page_size);
            assert_eq!(one.cached_tokens, 0, "{policy} P={page_size}");
            assert_eq!(one.evicted_tokens, 4 * 48, "{policy}");
            let two = run(&reqs, &policy, 96, page_size);
            assert_eq!(two.cached_tokens, 3 * 48, "{policy}");
        }
    }
    // Identical back-to-back requests still reuse within one request's capacity.
    let same = requests(&[&a, &a]);
    assert_eq!(run(&same, "lru", 48, 16).cached_tokens, 48);
}

#[test]
fn prompts_larger_than_the_pool_are_skipped_without_evicting() {
    let reqs = requests(&[&run_of(0, 32), &run_of(100, 40), &run_of(0, 32)]);
    let r = run(&reqs, "lru", 32, 16);
    assert_eq!(r.skipped_requests, 1);
    assert_eq!(r.cached_tokens, 32, "the skipped request evicted nothing");
    assert_eq!(r.evicted_tokens, 0);
    assert_eq!(r.prompt_tokens, 32 + 40 + 32);
}

/// A tiny Mooncake trace with shared hash ids; expected cached tokens worked out by hand.
const FIXTURE: &str = r#"{"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]}
{"timestamp": 10, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 4]}
{"timestamp": 20, "input_length": 600, "output_length": 10, "hash_ids": [1, 5]}
{"timestamp": 30, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]}
{"timestamp": 40, "input_length": 300, "output_length": 10, "hash_ids": [1]}
{"timestamp": 50, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 4]}
{"timestamp": 60, "input_length": 512, "output_length": 10, "hash_ids": [9]}
"#;

#[test]
fn mooncake_fixture_exact_cached_tokens() {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fixture.jsonl");
    std::fs::write(&path, FIXTURE).unwrap();
    let w = load_mooncake(&path).unwrap();
    assert_eq!(w.requests.len(), 7);
    assert_eq!(w.requests[6].arrival_s, 0.06);
    let prompt_tokens = 1200 + 1100 + 600 + 1200 + 300 + 1100 + 512;
    // P = 512: whole blocks only. Request by request: 0, 1024 (ids 1 2), 512 (id 1),
    // 1024 (the third block is partial, never cached), 0 (300 < one page), 1024, 0.
    // P = 16: 0, 1024, 512, 1200 (all 75 pages of request 0), 288 (18 pages of block 1),
    // 1088 (68 pages of request 1), 0.
    for (page_size, expect) in [(512u32, 3584u64), (16, 4112)] {
        for policy in ["lru", "belady"] {
            let r = run(&w.requests, policy, HUGE, page_size);
            assert_eq!(r.cached_tokens, expect, "{policy} P={page_size}");
            assert_eq!(r.prompt_tokens, prompt_tokens);
        }
    }
    // Only whole blocks 1, 2 and 9 ever enter the tree at P = 512 (the others end inside a
    // page), so three pages — the largest prompt — lose nothing.
    let r = run(&w.requests, "lru", 3 * 512, 512);
    assert_eq!(
        (r.cached_tokens, r.evicted_tokens, r.skipped_requests),
        (3584, 0, 0)
    );
    // Two pages: the 3-page prompts are skipped; the rest find nothing cached but block 1,
    // which the 300-token prompt cannot use (less than a page).
    let r = run(&w.requests, "lru", 2 * 512, 512);
    assert_eq!(
        (r.cached_tokens, r.evicted_tokens, r.skipped_requests),
        (0, 0, 4)
    );
    assert_eq!(
        r.prompt_tokens, prompt_tokens,
        "skipped prompts still count"
    );
}

#[test]
fn lru_and_mru_differ_on_crafted_sequences() {
    let (a, b, c) = (run_of(0, 4), run_of(10, 4), run_of(20, 4));
    // Room for two prompts. A B A C A: LRU evicts B for C and hits A twice; MRU evicts A
    // (just used) for C, then misses it.
    let reqs = requests(&[&a, &b, &a, &c, &a]);
    assert_eq!(run(&reqs, "lru", 8, 1).cached_tokens, 8);
    assert_eq!(run(&reqs, "mru", 8, 1).cached_tokens, 4);
    // The cyclic pattern A B C A B C: LRU always evicts what comes next (no hit); MRU keeps A
    // and then C.
    let cyclic = requests(&[&a, &b, &c, &a, &b, &c]);
    assert_eq!(run(&cyclic, "lru", 8, 1).cached_tokens, 0);
    assert_eq!(run(&cyclic, "mru", 8, 1).cached_tokens, 8);
    assert_eq!(run(&cyclic, "belady", 8, 1).cached_tokens, 8);
}

/// A random workload with shared prefixes: prompts are paths in a random tree of segments.
fn random_tree_workload(seed: u64, n: usize) -> Vec<Request> {
    let mut rng = kv_pool::rng::SplitMix64::new(seed);
    let mut prefixes: Vec<Vec<u32>> = vec![Vec::new()];
    let mut next_token = 0u32;
    let mut out = Vec::new();
    for _ in 0..n {
        let base = prefixes[rng.below(prefixes.len())].clone();
        let mut tokens = base;
        let extra = 1 + rng.below(24) as u32;
        tokens.extend(next_token..next_token + extra);
        next_token += extra;
        if prefixes.len() < 12 {
            prefixes.push(tokens.clone());
        }
        out.push(Request {
            tokens,
            output_len: 1,
            arrival_s: 0.0,
        });
    }
    out
}

/// Asserts that Belady serves at least as many tokens from cache as every other policy on
/// `reqs`, at page sizes 1 and 4 and capacities of one to three longest prompts.
fn assert_belady_wins(what: &str, reqs: &[Request]) {
    for page_size in [1u32, 4] {
        let longest = reqs.iter().map(|r| r.tokens.len()).max().unwrap();
        for factor in [1, 2, 3] {
            let capacity = page_align_capacity(longest * factor, page_size).unwrap();
            let belady = run(reqs, "belady", capacity, page_size);
            for other in parse_policies("all,cost-aware").unwrap() {
                let r = run(reqs, &other, capacity, page_size);
                assert!(
                    belady.cached_tokens >= r.cached_tokens,
                    "{what} P={page_size} capacity {capacity}: belady {} < {other} {}",
                    belady.cached_tokens,
                    r.cached_tokens
                );
            }
        }
    }
}

#[test]
fn belady_beats_every_other_policy_on_small_random_workloads() {
    for seed in 0..4 {
        let gsp = GspConfig {
            num_groups: 6,
            prompts_per_group: 5,
            system_prompt_len: 40 + seed as usize,
            question_len: 9,
            seed,
            ..GspConfig::default()
        };
        assert_belady_wins(
            &format!("gsp seed {seed}"),
            &gsp.generate().unwrap().requests,
        );
        let chat = MultiTurnConfig {
            sessions: 5,
            turns: 5,
            input_len: 13,
            output_len: 5,
            seed,
            ..MultiTurnConfig::default()
        };
        assert_belady_wins(
            &format!("multiturn seed {seed}"),
            &chat.generate().unwrap().requests,
        );
    }
}

/// Prompts that branch anywhere (paths in a random tree of segments). radix-cache's Belady
/// keys a leaf by the next use of its *first* page and partial eviction takes all the pages
/// needed from one leaf, so on such trees it is not always optimal (seed 1, P = 1, capacity
/// 176: belady 2,965 tokens, filo 2,992). Keying by the leaf's last page and evicting Belady's
/// leaves one page at a time gave no loss in 2,880 comparisons; enable once radix-cache does so.
#[test]

fn belady_beats_every_other_policy_on_random_prefix_trees() {
    for seed in 0..6 {
        assert_belady_wins(
            &format!("tree seed {seed}"),
            &random_tree_workload(seed, 80),
        );
    }
}

#[test]
fn sweeps_run_in_parallel_with_the_same_results() {
    let w = MultiTurnConfig {
        sessions: 6,
        turns: 4,
        input_len: 30,
        output_len: 10,
        ..MultiTurnConfig::default()
    }
    .generate()
    .unwrap();
    let mut cfg = SweepConfig {
        policies: parse_policies("all,belady,cost-aware").unwrap(),
        capacities: vec![128, 512, 2048],
        page_size: 16,
        check: true,
        jobs: 1,
        tier: None,
    };
    let serial = run_sweep(&w.requests, &cfg, &|_| {}).unwrap();
    cfg.jobs = 3;
    let done = std::sync::atomic::AtomicU64::new(0);
    let parallel = run_sweep(&w.requests, &cfg, &|n| {
        done.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    })
    .unwrap();
    assert_eq!(serial.len(), 9 * 3);
    assert_eq!(done.into_inner(), 27 * w.requests.len() as u64);
    let strip = |rs: Vec<ReplayResult>| {
        rs.into_iter()
            .map(|r| {
                (
                    r.policy,
                    r.capacity_tokens,
                    r.cached_tokens,
                    r.evicted_tokens,
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(strip(serial), strip(parallel));
}

#[test]
fn bad_input_is_a_typed_error() {
    // A malformed line names its number.
    let text = format!(
        "{}\n\n{{\"timestamp\": 1, \"input_length\": \"x\"}}\n",
        FIXTURE.lines().next().unwrap()
    );
    match parse_mooncake(text.as_bytes(), "bad.jsonl") {
        Err(EngineError::TraceLine { line, path, .. }) => {
            assert_eq!((line, path.as_str()), (3, "bad.jsonl"))
        }
        other => panic!("{other:?}"),
    }
    let missing = load_mooncake(std::path::Path::new("/nonexistent/trace.jsonl")).unwrap_err();
    assert!(matches!(missing, EngineError::Io { .. }), "{missing}");
    assert!(missing.to_string().contains("/nonexistent/trace.jsonl"));
    // Unknown policy.
    let err = parse_policies("lru,clock").unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::InvalidArgument {
                flag: "--policy",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("clock") && err.to_string().contains("belady"));
    // Zero capacity, through the helpers and the replay itself.
    let err = page_align_capacity(0, 16).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::InvalidArgument {
                flag: "--capacity-tokens",
                ..
            }
        ),
        "{err}"
    );
    let reqs = requests(&[&[1, 2, 3]]);
    let lru = build_policy("lru", None).unwrap();
    assert!(replay_through_cache(&reqs, lru, 0, 1, ReplayOptions::default(), &|_| {}).is_err());
    let cfg = SweepConfig {
        policies: vec!["lru".into()],
        capacities: vec![0],
        page_size: 1,
        check: false,
        jobs: 1,
        tier: None,
    };
    assert!(run_sweep(&reqs, &cfg, &|_| {}).is_err());
    // A policy the sweep cannot build is refused before any replay.
    let cfg = SweepConfig {
        policies: vec!["nope".into()],
        capacities: vec![16],
        ..cfg
    };
    assert!(matches!(
        run_sweep(&reqs, &cfg, &|_| {}),
        Err(EngineError::InvalidArgument {
            flag: "--policy",
            ..
        })
    ));
    assert_eq!(BuiltinPolicy::ALL.len(), 7);
}

#[test]
fn plot_writes_a_png() {
    let w = GspConfig {
        num_groups: 4,
        prompts_per_group: 4,
        system_prompt_len: 64,
        question_len: 8,
        ..GspConfig::default()
    }
    .generate()
    .unwrap();
    let cfg = SweepConfig {
        policies: parse_policies("lru,mru,belady").unwrap(),
        capacities: vec![80, 160, 320, 640],
        page_size: 8,
        check: false,
        jobs: 2,
        tier: None,
    };
    let results = run_sweep(&w.requests, &cfg, &|_| {}).unwrap();
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hit_rates.png");
    engine::plot::plot_hit_rates(&results, &w.name, &path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 10_000);
    let bad =
        engine::plot::plot_hit_rates(&results, "x", std::path::Path::new("/nonexistent/x.png"));
    assert!(matches!(bad, Err(EngineError::Plot { .. })), "{bad:?}");
}

/// A simulated host tier with `write_policy`, `ratio` × the capacity, and an L3 store if
/// `storage`.
fn tier(write_policy: &str, ratio: f64, storage: bool) -> engine::sim_tier::SimTier {
    let kind = storage.then_some(hicache::storage::StorageKind::File);
    engine::sim_tier::SimTier::with_policy(write_policy.parse().unwrap(), ratio, kind)
}

fn run_tiered(
    reqs: &[Request],
    capacity: usize,
    page_size: u32,
    tier: engine::sim_tier::SimTier,
) -> ReplayResult {
    let cfg = SweepConfig {
        policies: vec!["lru".into()],
        capacities: vec![capacity],
        page_size,
        check: true,
        jobs: 1,
        tier: Some(tier),
    };
    run_sweep(reqs, &cfg, &|_| {}).unwrap().remove(0)
}

/// A, B, A on a device that holds one prompt: without a tier the second A misses; with one,
/// A was demoted to host (write-through backed it up at its insert, write-back at its
/// eviction) and loads back; write-through-selective backs up only at a second hit, so A was
/// deleted.
#[test]
fn the_host_tier_serves_what_the_device_evicted() {
    let (a, b) = (run_of(0, 64), run_of(1000, 64));
    let reqs = requests(&[&a, &b, &a]);
    let plain = run(&reqs, "lru", 64, 16);
    assert_eq!((plain.cached_tokens, plain.tiers), (0, None));
    for (policy, host_hit) in [
        ("write_through", 64),
        ("write_back", 64),
        ("write_through_selective", 0),
    ] {
        let r = run_tiered(&reqs, 64, 16, tier(policy, 2.0, false));
        let t = r.tiers.clone().unwrap();
        assert_eq!(t.write_policy, policy);
        // SGLang's host sizing: (64 × 2 // 16 + 1) × 16.
        assert_eq!(t.host_capacity_tokens, 144);
        assert_eq!(
            (t.device_hit_tokens, t.host_hit_tokens, t.storage_hit_tokens),
            (0, host_hit, 0),
            "{policy}"
        );
        assert_eq!(r.cached_tokens, host_hit, "{policy}");
        assert_eq!(t.host_hit_rate, host_hit as f64 / 192.0);
    }
}

/// Six 512-token prompts, then the first again, on a device holding one and a host holding
/// four: the first prompt left the host too, so only the L3 store still has it; the prefetch
/// at its arrival brings it back to host and the load-back to the device.
#[test]
fn the_l3_store_serves_what_the_host_evicted() {
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| run_of(i * 10_000, 512)).collect();
    let mut order: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    order.push(&prompts[0]);
    let reqs = requests(&order);
    let host_only = run_tiered(&reqs, 512, 16, tier("write_through", 4.0, false));
    let t = host_only.tiers.clone().unwrap();
    assert_eq!(t.host_capacity_tokens, 2064);
    assert_eq!(host_only.cached_tokens, 0);
    let with_l3 = run_tiered(&reqs, 512, 16, tier("write_through", 4.0, true));
    let t = with_l3.tiers.clone().unwrap();
    assert!(t.storage);
    assert_eq!(
        (t.device_hit_tokens, t.host_hit_tokens, t.storage_hit_tokens),
        (0, 0, 512)
    );
    assert_eq!(with_l3.cached_tokens, 512);
    // The JSON line carries the tier fields; a replay without a tier has none of them.
    let json = engine::report::render_json_lines(&[with_l3, host_only.clone()]);
    let lines: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["storage_hit_tokens"], 512);
    assert_eq!(lines[0]["write_policy"], "write_through");
    let plain = run(&reqs, "lru", 512, 16);
    let json = engine::report::render_json_lines(&[plain]);
    assert!(!json.contains("hit_tokens"), "{json}");
}

/// The plot of a tiered sweep draws each policy's device-only hit rate beside its total.
#[test]
fn a_tiered_sweep_plots() {
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| run_of(i * 1000, 64)).collect();
    let order: Vec<&[u32]> = (0..12).map(|i| prompts[i % 4].as_slice()).collect();
    let cfg = SweepConfig {
        policies: vec!["lru".into()],
        capacities: vec![64, 128],
        page_size: 16,
        check: true,
        jobs: 1,
        tier: Some(tier("write_through", 4.0, false)),
    };
    let results = run_sweep(&requests(&order), &cfg, &|_| {}).unwrap();
    assert!(results
        .iter()
        .all(|r| r.tiers.as_ref().unwrap().host_hit_tokens > 0));
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("tiered_hit_rates.png");
    engine::plot::plot_hit_rates(&results, "tiered", &path).unwrap();
    assert!(std::fs::read(&path).unwrap().starts_with(b"\x89PNG"));
}

/// On a multi-turn workload every turn repeats the session so far: with a small device the
/// tiers serve what it cannot hold, and the replay's checks (accounting after every request,
/// both partitions at the end) hold for every write policy, with and without L3.
#[test]
fn tiered_replays_of_a_multiturn_workload_keep_every_invariant() {
    let w = MultiTurnConfig {
        sessions: 6,
        turns: 4,
        input_len: 100,
        output_len: 20,
        ..MultiTurnConfig::default()
    }
    .generate()
    .unwrap();
    let plain = run(&w.requests, "lru", 512, 16);
    for policy in ["write_through", "write_through_selective", "write_back"] {
        for storage in [false, true] {
            let r = run_tiered(&w.requests, 512, 16, tier(policy, 2.0, storage));
            let t = r.tiers.clone().unwrap();
            assert_eq!(
                r.cached_tokens,
                t.device_hit_tokens + t.host_hit_tokens + t.storage_hit_tokens
            );
            assert!(r.cached_tokens >= plain.cached_tokens, "{policy} {storage}");
            assert!(t.host_hit_tokens > 0, "{policy} {storage}: {t:?}");
            // Write-through-selective backs up only what was hit twice: none of it reached L3
            // before the host let it go.
            let l3 = storage && policy != "write_through_selective";
            assert_eq!(t.storage_hit_tokens > 0, l3, "{policy} {storage}: {t:?}");
        }
    }
}
