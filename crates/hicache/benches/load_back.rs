//! Host → device load-back of N pages through `CpuCacheController` (queued, started, copied
//! layer by layer, acknowledged), against one plain `memcpy` of the same bytes in the same run.
//!
//! Shape: Llama-3-8B's KV (8 KV heads × 128, 32 layers, bf16: 128 KiB per token), P = 16,
//! 64 pages (1024 tokens, 128 MiB). Each host layout, with the pages in one run on both sides
//! ("contiguous") and in a random order on both sides ("scattered", as a long-running
//! allocator hands them out).
//!
//! `cargo bench -p hicache --bench load_back -- --noplot`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hicache::controller::CpuCacheController;
use kv_pool::{
    CacheController, HostKvPool, HostKvStore, HostLayout, KvDtype, KvLayout, KvShape, Page, Slot,
    SplitMix64,
};

const P: u32 = 16;
const PAGES: usize = 64;

fn slots_of(pages: &[u32]) -> Vec<Slot> {
    pages.iter().flat_map(|&p| Page(p).slots(P)).collect()
}

fn bench(c: &mut Criterion) {
    let shape = KvShape::mha(8, 128, 128, 32, KvDtype::Bf16).unwrap();
    let layout = KvLayout::new(shape, P, PAGES * P as usize).unwrap();
    let bytes = PAGES * layout.page_bytes();
    let mut g = c.benchmark_group("load_back");
    g.throughput(Throughput::Bytes(bytes as u64))
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));

    let src = vec![7u8; bytes];
    let mut dst = vec![0u8; bytes];
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
        })
    });

    let mut seed = SplitMix64::new(1);
    let ordered: Vec<u32> = (1..=PAGES as u32).collect();
    let mut shuffled_d = ordered.clone();
    seed.shuffle(&mut shuffled_d);
    let mut shuffled_h = ordered.clone();
    seed.shuffle(&mut shuffled_h);
    for hl in HostLayout::ALL {
        for (name, dpages, hpages) in [
            ("contiguous", &ordered, &ordered),
            ("scattered", &shuffled_d, &shuffled_h),
        ] {
            let store = HostKvStore::new(layout).unwrap();
            let pool = HostKvPool::new(shape, P, PAGES * P as usize, hl).unwrap();
            // SAFETY: `store` outlives the controller (dropped at the end of this iteration)
            // and nothing else touches it.
            let mut ctl = unsafe { CpuCacheController::new(&store, pool, None) }.unwrap();
            let handle = ctl.handle();
            let (d, h) = (slots_of(dpages), slots_of(hpages));
            g.bench_function(format!("{hl}/{name}"), |b| {
                b.iter(|| {
                    let op = ctl.load(&h, &d);
                    let gate = handle.start_loads();
                    kv_pool::LayerWait::wait_layer(&gate, shape.layers as usize - 1).unwrap();
                    ctl.wait(op);
                    black_box(ctl.poll_acks());
                })
            });
            drop(ctl);
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
