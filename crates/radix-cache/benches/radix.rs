//! Radix-cache benches.
//!
//! `cargo bench -p radix-cache --bench radix`
//!
//! - `gsp_match_insert`: match + insert of every prompt of SGLang's generated-shared-prefix
//!   workload (64 groups × 16 prompts, 2,048-token system prompt, 128-token question, shuffled)
//!   into an empty tree at page size 1; throughput in prompt tokens.
//! - `evict_one_page_40k_leaves`: one `evict` of one page (P = 16) from a tree with 40,000
//!   evictable leaves, beside what SGLang does per call: heapify every leaf's key and pop one.

use std::collections::BinaryHeap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kv_pool::rng::SplitMix64;
use kv_pool::{Allocator, ExtendRequest, PagedAllocator, Slot};
use radix_cache::{BuiltinPolicy, InsertOptions, PrefixCache, RadixCache};

/// SGLang's generated-shared-prefix prompts with its defaults, shuffled.
fn gsp_prompts(seed: u64) -> Vec<Vec<u32>> {
    let (groups, per_group, system, question) = (64, 16, 2048, 128);
    // The same seed and `next_u64` sequence as the bench's former private SplitMix copy, so
    // the prompts (and the numbers) stay comparable across that change.
    let mut s = SplitMix64::new(seed);
    let tok = |s: &mut SplitMix64| (s.next_u64() % 128_000) as u32;
    let mut prompts = Vec::new();
    for _ in 0..groups {
        let sys: Vec<u32> = (0..system).map(|_| tok(&mut s)).collect();
        for _ in 0..per_group {
            let mut p = sys.clone();
            p.extend((0..question).map(|_| tok(&mut s)));
            prompts.push(p);
        }
    }
    for i in (1..prompts.len()).rev() {
        let j = (s.next_u64() % (i as u64 + 1)) as usize;
        prompts.swap(i, j);
    }
    prompts
}

fn gsp_match_insert(c: &mut Criterion) {
    let prompts = gsp_prompts(1);
    let total: usize = prompts.iter().map(Vec::len).sum();
    let mut g = c.benchmark_group("gsp_match_insert");
    g.throughput(Throughput::Elements(total as u64));
    g.sample_size(20);
    let mut out = Vec::with_capacity(4096);
    let mut slots = Vec::with_capacity(4096);
    g.bench_function("P=1", |b| {
        b.iter(|| {
            let mut cache = RadixCache::new(1, BuiltinPolicy::Lru);
            let mut next_slot = 1u32;
            for p in &prompts {
                out.clear();
                let m = cache.match_prefix(p, None, &mut out);
                // Slot values stand in for an allocator's: the tree never reads them.
                slots.clear();
                slots.extend_from_slice(&out);
                slots.extend((next_slot..next_slot + (p.len() - m.len) as u32).map(Slot));
                next_slot += (p.len() - m.len) as u32;
                black_box(
                    cache
                        .insert(p, None, &slots, InsertOptions::default())
                        .unwrap(),
                );
            }
            cache
        })
    });
    g.finish();
}

fn evict_one_page(c: &mut Criterion) {
    const LEAVES: usize = 40_000;
    const P: u32 = 16;
    let mut g = c.benchmark_group("evict_one_page_40k_leaves");
    // A shared 64-token trunk and 40,000 two-page leaves under it.
    let mut alloc = PagedAllocator::new((LEAVES * 2 + 8) * P as usize, P).unwrap();
    let mut cache = RadixCache::new(P, BuiltinPolicy::Lru);
    let trunk: Vec<u32> = (0..64).collect();
    let key = |i: usize| {
        let mut k = trunk.clone();
        k.extend((0..2 * P).map(|j| 1_000_000 + (i as u32) * 2 * P + j));
        k
    };
    let insert = |cache: &mut RadixCache, alloc: &mut PagedAllocator, k: &[u32]| {
        let mut prefix = Vec::new();
        let m = cache.match_prefix(k, None, &mut prefix);
        let mut fresh = Vec::new();
        let req = ExtendRequest {
            prefix_len: m.len,
            seq_len: k.len(),
            last_loc: prefix.last().copied(),
        };
        alloc.alloc_extend(&[req], &mut fresh).unwrap();
        prefix.extend_from_slice(&fresh);
        cache
            .insert(k, None, &prefix, InsertOptions::default())
            .unwrap();
    };
    for i in 0..LEAVES {
        insert(&mut cache, &mut alloc, &key(i));
    }
    assert_eq!(cache.evictable_leaves(), LEAVES);
    g.bench_function("evict", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                // The LRU victim loses its tail page; restore it outside the timing.
                let victim = cache.eviction_order()[0].1.clone();
                let t = Instant::now();
                let freed = cache.evict(P as usize, &mut alloc).unwrap();
                total += t.elapsed();
                assert_eq!(freed, P as usize);
                let mut k = trunk.clone();
                k.extend_from_slice(&victim);
                insert(&mut cache, &mut alloc, &k);
            }
            total
        })
    });
    // SGLang's per-call work: a heap over every evictable leaf's key, then one pop.
    let keys: Vec<(i64, u32)> = (0..LEAVES as u32)
        .map(|i| (-(i as i64 * 7919 % 40_009), i))
        .collect();
    g.bench_function("sglang_heap_rebuild_baseline", |b| {
        b.iter(|| {
            let mut heap: BinaryHeap<(i64, u32)> = black_box(&keys).iter().copied().collect();
            black_box(heap.pop())
        })
    });
    g.finish();
}

criterion_group!(benches, gsp_match_insert, evict_one_page);
criterion_main!(benches);
