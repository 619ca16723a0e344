//! Helpers shared by the controller tests (`controller.rs`, `controller_rows.rs`).

use std::time::{Duration, Instant};

use kv_pool::{
    Ack, CacheController, HostKvPool, KvDtype, KvShape, KvStore, Page, Slot, SplitMix64,
};

pub fn shapes() -> Vec<KvShape> {
    vec![
        KvShape::mha(2, 8, 4, 3, KvDtype::Bf16).unwrap(),
        KvShape::mla(12, 4, 2, KvDtype::F16).unwrap(),
        KvShape::double_sparse(2, 8, 4, 3, 2, KvDtype::Fp8E4m3).unwrap(),
    ]
}

/// `n` distinct random pages of `1..=pages` (sorted half the time, so long runs occur).
pub fn pick_pages(n: usize, pages: usize, seed: &mut SplitMix64) -> Vec<Page> {
    let mut all: Vec<u32> = (1..=pages as u32).collect();
    seed.shuffle(&mut all);
    all.truncate(n);
    if seed.next_u64() & 1 == 0 {
        all.sort_unstable();
    }
    all.into_iter().map(Page).collect()
}

pub fn slots_of(pages: &[Page], p: u32) -> Vec<Slot> {
    pages.iter().flat_map(|pg| pg.slots(p)).collect()
}

pub fn packed(store: &dyn KvStore, pages: &[Page]) -> Vec<u8> {
    let mut out = vec![0u8; pages.len() * store.layout().page_bytes()];
    store.read_pages(pages, &mut out).unwrap();
    out
}

pub fn pool_packed(pool: &HostKvPool, pages: &[Page]) -> Vec<u8> {
    let mut out = vec![0u8; pages.len() * pool.layout().page_bytes()];
    pool.read_pages(pages, &mut out).unwrap();
    out
}

/// Polls until `want` acks arrived (10 s at most).
pub fn poll_n(c: &mut dyn CacheController, want: usize) -> Vec<Ack> {
    let start = Instant::now();
    let mut got = Vec::new();
    while got.len() < want {
        got.extend(c.poll_acks());
        assert!(start.elapsed() < Duration::from_secs(10), "acks: {got:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(got.len() == want, "{got:?}");
    got
}
