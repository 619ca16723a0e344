//! Host → device load-back of N pages through `HiCacheController` (queued, started, copied
//! layer by layer, acknowledged), against one plain `memcpy` of the same bytes in the same run.
//!
//! Shape: Llama-3-8B's KV (8 KV heads × 128, 32 layers, bf16: 128 KiB per token), P = 16,
//! 64 pages (1024 tokens, 128 MiB). Each host layout, with the pages in one run on both sides
//! ("contiguous") and in a random order on both sides ("scattered", as a long-running
//! allocator hands them out).
//!
//! Then, where a wgpu adapter exists, the same load-back into a `WgpuKvStore` through its
//! `WgpuKvRows` handle (f16 KV: wgpu stores no bf16; the same bytes), against the store's own
//! `write_pages` of the same bytes in the same run.
//!
//! `cargo bench -p hicache --bench load_back -- --noplot`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hicache::controller::{ControllerHandle, HiCacheController};
use kv_pool::{
    CacheController, HostKvPool, HostKvStore, HostLayout, KvDtype, KvLayout, KvShape, Page, Slot,
    SplitMix64,
};

const P: u32 = 16;
const PAGES: usize = 64;

fn slots_of(pages: &[u32]) -> Vec<Slot> {
    pages.iter().flat_map(|&p| Page(p).slots(P)).collect()
}

/// One load-back: queued, started, waited for to its last layer and its ack.
fn load_back(
    ctl: &mut HiCacheController,
    handle: &ControllerHandle,
    host: &[Slot],
    device: &[Slot],
    layers: usize,
) {
    let op = ctl.load(host, device);
    let gate = handle.start_loads();
    kv_pool::LayerWait::wait_layer(&gate, layers - 1).unwrap();
    ctl.wait(op);
    black_box(ctl.poll_acks());
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
            let mut ctl = unsafe { HiCacheController::new(&store, pool, None) }.unwrap();
            let handle = ctl.handle();
            let (d, h) = (slots_of(dpages), slots_of(hpages));
            g.bench_function(format!("{hl}/{name}"), |b| {
                b.iter(|| load_back(&mut ctl, &handle, &h, &d, shape.layers as usize))
            });
            drop(ctl);
        }
    }
    g.finish();
    bench_wgpu(c, &shuffled_d, &shuffled_h);
}

/// The wgpu case: skipped, with the reason printed, without an adapter or f16 shaders.
fn bench_wgpu(c: &mut Criterion, shuffled_d: &[u32], shuffled_h: &[u32]) {
    use attention::Backend;
    let backend = match attention_wgpu::WgpuBackend::new(attention_wgpu::WgpuConfig::default()) {
        Ok(b) => b,
        Err(e) => {
            println!("SKIP load_back/wgpu: no wgpu backend ({e})");
            return;
        }
    };
    println!("load_back/wgpu: adapter {}", backend.report());
    let shape = KvShape::mha(8, 128, 128, 32, KvDtype::F16).unwrap();
    let layout = KvLayout::new(shape, P, PAGES * P as usize).unwrap();
    let mut store = match backend.new_kv_store(layout) {
        Ok(s) => s,
        Err(e) => {
            println!("SKIP load_back/wgpu: {e}");
            return;
        }
    };
    let bytes = PAGES * layout.page_bytes();
    let mut g = c.benchmark_group("load_back_wgpu");
    g.throughput(Throughput::Bytes(bytes as u64))
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    let pages: Vec<Page> = (1..=PAGES as u32).map(Page).collect();
    let data = vec![7u8; bytes];
    g.bench_function("write_pages", |b| {
        b.iter(|| {
            kv_pool::KvStore::write_pages(&mut store, &pages, black_box(&data)).unwrap();
            // Wait for the device: read one row back.
            let mut row = vec![0u8; shape.row_bytes(kv_pool::KvBuffer::Key)];
            kv_pool::KvStore::read_raw(&store, 31, kv_pool::KvBuffer::Key, &[Slot(P)], &mut row)
                .unwrap();
        })
    });
    let ordered: Vec<u32> = (1..=PAGES as u32).collect();
    for (name, dpages, hpages) in [
        ("contiguous", &ordered[..], &ordered[..]),
        ("scattered", shuffled_d, shuffled_h),
    ] {
        let pool = HostKvPool::new(shape, P, PAGES * P as usize, HostLayout::LayerFirst).unwrap();
        let rows = std::sync::Arc::new(store.device_rows());
        let mut ctl = HiCacheController::with_device_rows(rows, pool, None).unwrap();
        let handle = ctl.handle();
        let (d, h) = (slots_of(dpages), slots_of(hpages));
        g.bench_function(format!("layer_first/{name}"), |b| {
            b.iter(|| {
                load_back(&mut ctl, &handle, &h, &d, shape.layers as usize);
                // Wait for the device: read one row of the last layer back.
                let mut row = vec![0u8; shape.row_bytes(kv_pool::KvBuffer::Key)];
                kv_pool::KvStore::read_raw(&store, 31, kv_pool::KvBuffer::Key, &d[..1], &mut row)
                    .unwrap();
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
