//! Allocator benches, each beside a baseline in the same group (a plain copy of the same number
//! of u32 slots), so the ratio holds on a noisy machine.
//!
//! `cargo bench -p kv-pool --bench allocators`
//!
//! - `alloc_extend_256x1000`: 256 requests with a 1,000-token prefix extended by 1,000 tokens,
//!   at P = 1 and P = 16: `alloc_extend+free` frees the new pages again (so every iteration
//!   starts from the same state), `alloc_extend` times the allocation alone (the state is
//!   restored outside the timing); baseline: copying 256,000 u32 slots.
//! - `alloc_decode_256`: one decode step for 256 requests (1 in 16 starts a page at P = 16), then
//!   the new pages freed; baseline: copying 256 u32 slots.

use std::hint::black_box;

use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use kv_pool::{Allocator, DecodeRequest, ExtendRequest, PagedAllocator, Slot, TokenAllocator};

const REQUESTS: usize = 256;
const PREFIX: usize = 1000;
const EXTEND: usize = 1000;

fn boxed(p: u32, size: usize) -> Box<dyn Allocator> {
    if p == 1 {
        Box::new(TokenAllocator::new(size).unwrap())
    } else {
        Box::new(PagedAllocator::new(size, p).unwrap())
    }
}

/// Allocates every request's prefix; returns the allocator and each request's last prefix slot.
fn with_prefixes(p: u32, prefix: usize) -> (Box<dyn Allocator>, Vec<Slot>) {
    let size = (REQUESTS * (prefix + EXTEND + 2 * p as usize)).next_multiple_of(p as usize);
    let mut a = boxed(p, size);
    let batch = vec![
        ExtendRequest {
            prefix_len: 0,
            seq_len: prefix,
            last_loc: None
        };
        REQUESTS
    ];
    let mut out = Vec::new();
    a.alloc_extend(&batch, &mut out).unwrap();
    let last = out.chunks(prefix).map(|c| *c.last().unwrap()).collect();
    (a, last)
}

/// The baseline every allocator bench sits beside: copying `n` u32 slot ids.
fn copy_baseline(g: &mut BenchmarkGroup<'_, WallTime>, n: usize) {
    let src: Vec<u32> = (0..n as u32).collect();
    let mut dst: Vec<u32> = Vec::with_capacity(n);
    g.bench_function("copy_baseline", |b| {
        b.iter(|| {
            dst.clear();
            dst.extend_from_slice(black_box(&src));
            black_box(&dst);
        })
    });
}

fn alloc_extend(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_extend_256x1000");
    g.throughput(Throughput::Elements((REQUESTS * EXTEND) as u64));
    copy_baseline(&mut g, REQUESTS * EXTEND);
    for p in [1u32, 16] {
        let (mut a, last) = with_prefixes(p, PREFIX);
        let batch: Vec<ExtendRequest> = last
            .iter()
            .map(|&l| ExtendRequest {
                prefix_len: PREFIX,
                seq_len: PREFIX + EXTEND,
                last_loc: Some(l),
            })
            .collect();
        // Slots that continue the prefix's partial page stay allocated (they share its page).
        let continued = PREFIX.next_multiple_of(p as usize) - PREFIX;
        let mut out = Vec::with_capacity(REQUESTS * EXTEND);
        g.bench_function(format!("P={p} alloc_extend+free"), |b| {
            b.iter(|| {
                out.clear();
                a.alloc_extend(black_box(&batch), &mut out).unwrap();
                for seg in out.chunks(EXTEND) {
                    a.free(&seg[continued..]).unwrap();
                }
            })
        });
        // alloc_extend alone: the allocator is restored from a snapshot outside the timing.
        let start = a.backup_state();
        g.bench_function(format!("P={p} alloc_extend"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    a.restore_state(&start).unwrap();
                    out.clear();
                    let t = Instant::now();
                    a.alloc_extend(black_box(&batch), &mut out).unwrap();
                    total += t.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

fn alloc_decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_decode_256");
    g.throughput(Throughput::Elements(REQUESTS as u64));
    copy_baseline(&mut g, REQUESTS);
    for p in [1u32, 16] {
        // Requests of lengths 1000 + i (i < 256): at P = 16, 16 of them start a fresh page.
        let size = (REQUESTS * (PREFIX + 2 * REQUESTS)).next_multiple_of(p as usize);
        let mut a = boxed(p, size);
        let batch: Vec<ExtendRequest> = (0..REQUESTS)
            .map(|i| ExtendRequest {
                prefix_len: 0,
                seq_len: PREFIX + i,
                last_loc: None,
            })
            .collect();
        let mut out = Vec::new();
        a.alloc_extend(&batch, &mut out).unwrap();
        let mut decode = Vec::with_capacity(REQUESTS);
        let mut start = 0;
        for r in &batch {
            start += r.seq_len;
            decode.push(DecodeRequest {
                seq_len: r.seq_len + 1,
                last_loc: Some(out[start - 1]),
            });
        }
        let fresh: Vec<bool> = decode
            .iter()
            .map(|d| (d.seq_len - 1) % p as usize == 0)
            .collect();
        let mut slots = Vec::with_capacity(REQUESTS);
        let mut to_free = Vec::with_capacity(REQUESTS);
        g.bench_function(format!("P={p}"), |b| {
            b.iter(|| {
                slots.clear();
                a.alloc_decode(black_box(&decode), &mut slots).unwrap();
                to_free.clear();
                to_free.extend(
                    slots
                        .iter()
                        .zip(&fresh)
                        .filter(|(_, f)| **f)
                        .map(|(s, _)| *s),
                );
                a.free(&to_free).unwrap();
            })
        });
    }
    g.finish();
}

criterion_group!(benches, alloc_extend, alloc_decode);
criterion_main!(benches);
