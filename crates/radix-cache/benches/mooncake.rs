//! Radix-cache benches on the Mooncake conversation trace: the W2 and W3 workloads of the
//! peer benchmark (`shared/bench/peer-radix`), so a regression shows without it.
//!
//! `cargo bench -p radix-cache --bench mooncake`
//!
//! The trace is `shared/traces/mooncake_conversation.jsonl` beside the checkout (12,031
//! requests), or the file `KVSERVE_MOONCAKE_TRACE` names (e.g. the repository's
//! `traces/mooncake_synthetic.jsonl`, a second trace of the same form); without it the benches
//! print why and skip. Each request is its full 512-token blocks, one block id as one token (P = 1), as W2.
//!
//! - `mooncake_match_insert/P=1` (W2): `match_prefix` then `insert` of every request into an
//!   empty tree, slot values from a counter; throughput in blocks.
//! - `mooncake_evict/{single,batch}` (W3): from the tree W2 leaves (slots from a kv-pool
//!   `TokenAllocator`), LRU, 10,000 blocks per iteration as 10,000 `evict(1)` calls or one
//!   `evict(10_000)`; the tree is reloaded (untimed) when fewer than 10,000 blocks are left, so
//!   the figure averages over draining it.
//! - `mooncake_replay_policy/{lru,lfu,cost-aware,lineage-ttl}`: the cost of a policy's keys: the
//!   whole trace replayed (match, evict for the missed blocks, insert) through a tree whose
//!   allocator holds 1/8 of the trace's blocks, so every request after the first few evicts;
//!   throughput in blocks. `lru` keeps its leaves in the O(1) list, the others in the ordered
//!   set.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kv_pool::{Allocator, Slot, TokenAllocator};
use radix_cache::{AnyEvictionPolicy, BuiltinPolicy, InsertOptions, PrefixCache, RadixCache};

const BLOCK: usize = 512;
const EVICT_N: usize = 10_000;

/// The trace's path: `KVSERVE_MOONCAKE_TRACE`, else `shared/traces` beside the checkout.
fn trace_path() -> PathBuf {
    std::env::var_os("KVSERVE_MOONCAKE_TRACE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../../shared/traces/mooncake_conversation.jsonl")
        })
}

/// Per request its full blocks' ids (requests without a full block dropped), or why not.
fn mooncake_requests() -> Result<Vec<Vec<u32>>, String> {
    let path = trace_path();
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let bad = || format!("{}:{}: not a Mooncake trace line", path.display(), n + 1);
        let v: serde_json::Value = serde_json::from_str(line).map_err(|_| bad())?;
        let len = v["input_length"].as_u64().ok_or_else(bad)? as usize;
        let ids = v["hash_ids"].as_array().ok_or_else(bad)?;
        let ids: Option<Vec<u32>> = ids
            .iter()
            .take(len / BLOCK)
            .map(|id| id.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect();
        let ids = ids.ok_or_else(bad)?;
        if !ids.is_empty() {
            out.push(ids);
        }
    }
    Ok(out)
}

fn requests_or_skip(bench: &str) -> Option<Vec<Vec<u32>>> {
    match mooncake_requests() {
        Ok(r) => Some(r),
        Err(why) => {
            println!("{bench}: skipped ({why}; set KVSERVE_MOONCAKE_TRACE to the trace)");
            None
        }
    }
}

/// W2: match, then insert with counter slots.
fn mooncake_match_insert(c: &mut Criterion) {
    let Some(reqs) = requests_or_skip("mooncake_match_insert") else {
        return;
    };
    let blocks: usize = reqs.iter().map(Vec::len).sum();
    let mut g = c.benchmark_group("mooncake_match_insert");
    g.throughput(Throughput::Elements(blocks as u64));
    g.sample_size(10);
    let mut slots = Vec::with_capacity(4096);
    g.bench_function("P=1", |b| {
        b.iter(|| {
            let mut cache = RadixCache::new(1, BuiltinPolicy::Lru);
            let mut next = 1u32;
            for r in &reqs {
                slots.clear();
                let m = cache.match_prefix(r, None, &mut slots);
                let fresh = (r.len() - m.len) as u32;
                slots.extend((next..next + fresh).map(Slot));
                next += fresh;
                black_box(
                    cache
                        .insert(r, None, &slots, InsertOptions::default())
                        .unwrap(),
                );
            }
            cache
        })
    });
    g.finish();
}

/// The tree W2 leaves, its slots from a real allocator.
fn load(reqs: &[Vec<u32>], blocks: usize) -> (RadixCache, TokenAllocator) {
    let mut cache = RadixCache::new(1, BuiltinPolicy::Lru);
    let mut alloc = TokenAllocator::new(blocks).unwrap();
    let mut out = Vec::with_capacity(4096);
    for r in reqs {
        out.clear();
        let m = cache.match_prefix(r, None, &mut out);
        alloc.alloc(r.len() - m.len, &mut out).unwrap();
        let ins = cache
            .insert(r, None, &out, InsertOptions::default())
            .unwrap();
        if ins.prefix_len > m.len {
            alloc.free(&out[m.len..ins.prefix_len]).unwrap();
        }
    }
    (cache, alloc)
}

/// W3: 10,000 blocks evicted per iteration, one block per call or in one call.
fn mooncake_evict(c: &mut Criterion) {
    let Some(reqs) = requests_or_skip("mooncake_evict") else {
        return;
    };
    let blocks: usize = reqs.iter().map(Vec::len).sum();
    let mut g = c.benchmark_group("mooncake_evict");
    g.throughput(Throughput::Elements(EVICT_N as u64));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(3));
    let mut state = load(&reqs, blocks);
    for (name, calls, per_call) in [("single", EVICT_N, 1), ("batch", 1, EVICT_N)] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if state.0.evictable_size() < EVICT_N {
                        state = load(&reqs, blocks);
                    }
                    let (cache, alloc) = &mut state;
                    let t = Instant::now();
                    for _ in 0..calls {
                        black_box(cache.evict(per_call, alloc).unwrap());
                    }
                    total += t.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

/// One replay of `reqs` with `policy` over `capacity` slots (P = 1): match, evict the shortfall,
/// allocate, insert, unlock. Returns the blocks served from the cache.
fn replay(reqs: &[Vec<u32>], policy: AnyEvictionPolicy, capacity: usize) -> usize {
    let mut cache = RadixCache::new(1, policy);
    let mut alloc = TokenAllocator::new(capacity).unwrap();
    let mut out = Vec::with_capacity(4096);
    let mut hits = 0;
    for r in reqs.iter().filter(|r| r.len() <= capacity) {
        out.clear();
        let m = cache.match_prefix(r, None, &mut out);
        hits += m.len;
        cache.inc_lock_ref(m.last_node).unwrap();
        let need = r.len() - m.len;
        if need > alloc.available_size() {
            let short = need - alloc.available_size();
            cache.evict(short, &mut alloc).unwrap();
        }
        alloc.alloc(need, &mut out).unwrap();
        let ins = cache
            .insert(r, None, &out, InsertOptions::default())
            .unwrap();
        if ins.prefix_len > m.len {
            alloc.free(&out[m.len..ins.prefix_len]).unwrap();
        }
        cache.dec_lock_ref(m.last_node).unwrap();
    }
    hits
}

/// Every policy's cost per block over the same replay.
fn mooncake_replay_policy(c: &mut Criterion) {
    let Some(reqs) = requests_or_skip("mooncake_replay_policy") else {
        return;
    };
    let blocks: usize = reqs.iter().map(Vec::len).sum();
    let mut g = c.benchmark_group("mooncake_replay_policy");
    g.throughput(Throughput::Elements(blocks as u64));
    g.sample_size(10);
    for name in ["lru", "lfu", "cost-aware", "lineage-ttl"] {
        let policy = AnyEvictionPolicy::from_name(name).unwrap();
        g.bench_function(name, |b| {
            b.iter(|| black_box(replay(&reqs, policy.clone(), blocks / 8)))
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    mooncake_match_insert,
    mooncake_evict,
    mooncake_replay_policy
);
criterion_main!(benches);
