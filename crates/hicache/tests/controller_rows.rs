//! `HiCacheController::with_device_rows`: the controller over a `DeviceKvRows` handle (the path
//! a wgpu store takes), run here over `kv_pool::testing::LockedStoreRows` on the host. Bytes
//! land exactly and identically to the memory-regions path (every host layout, MHA / MLA /
//! DoubleSparse, P 1 and 16); a pass waiting per layer sees each layer loaded; a handle that
//! fails turns into failed acks and a failed pass, never a panic or a hang.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

mod common;

use common::{packed, pick_pages, poll_n, pool_packed, shapes, slots_of};
use hicache::controller::HiCacheController;
use kv_pool::testing::LockedStoreRows;
use kv_pool::{
    AckOutcome, CacheController, DeviceKvRows, HostKvPool, HostKvStore, HostLayout, KvBuffer,
    KvDtype, KvLayout, KvPoolError, KvShape, KvStore, LayerWait, Page, Slot, SplitMix64,
};

fn pool(layout: &KvLayout, pages: usize, hl: HostLayout) -> HostKvPool {
    HostKvPool::new(
        layout.shape,
        layout.page_size,
        pages * layout.page_size as usize,
        hl,
    )
    .unwrap()
}

#[test]
fn bytes_land_exactly_and_as_through_memory_regions() {
    let mut seed = SplitMix64::new(31);
    for shape in shapes() {
        for p in [1u32, 16] {
            let layout = KvLayout::new(shape, p, 24 * p as usize).unwrap();
            let src = kv_pool::testing::random_host_store(layout, &mut seed);
            for hl in HostLayout::ALL {
                let n = 1 + seed.below(12);
                let dpages = pick_pages(n, 24, &mut seed);
                let hpages = pick_pages(n, 32, &mut seed);
                let (d, h) = (slots_of(&dpages, p), slots_of(&hpages, p));
                let split = d.len() / 2;

                // Device → host through the handle: two writes, one merged batch.
                let rows = LockedStoreRows::new(src.clone());
                let mut c = HiCacheController::with_device_rows(
                    Arc::new(rows),
                    pool(&layout, 32, hl),
                    None,
                )
                .unwrap();
                c.write(&d[..split], &h[..split]);
                c.write(&d[split..], &h[split..]);
                let acks = poll_n(&mut c, 2);
                assert!(
                    acks.iter().all(|a| a.outcome == AckOutcome::Done),
                    "{acks:?}"
                );
                let via_rows = pool_packed(c.host_pool(), &hpages);
                assert_eq!(via_rows, packed(&src, &dpages), "{hl} P={p}");

                // The same write through the store's memory: the same host bytes.
                // SAFETY: `src` outlives the controller (dropped below) and is only read.
                let mut m =
                    unsafe { HiCacheController::new(&src, pool(&layout, 32, hl), None) }.unwrap();
                m.write(&d, &h);
                poll_n(&mut m, 1);
                assert_eq!(pool_packed(m.host_pool(), &hpages), via_rows, "{hl} P={p}");
                drop(m);

                // Host → device through the handle, layer by layer, into an empty store.
                let dst = LockedStoreRows::new(HostKvStore::new(layout).unwrap());
                let host = {
                    let mut pool = pool(&layout, 32, hl);
                    pool.copy_from_store(&src, &d, &h).unwrap();
                    pool
                };
                let mut c =
                    HiCacheController::with_device_rows(Arc::new(dst.clone()), host, None).unwrap();
                let tpages = pick_pages(n, 24, &mut seed);
                let op = c.load(&h, &slots_of(&tpages, p));
                let gate = c.handle().start_loads();
                for layer in 0..shape.layers as usize {
                    gate.wait_layer(layer).unwrap();
                }
                c.wait(op);
                assert_eq!(poll_n(&mut c, 1)[0].outcome, AckOutcome::Done);
                drop(c);
                assert_eq!(
                    packed(&*dst.store(), &tpages),
                    packed(&src, &dpages),
                    "{hl} P={p}"
                );
            }
        }
    }
}

#[test]
fn a_pass_waiting_per_layer_sees_each_layer_loaded() {
    let shape = KvShape::mha(4, 32, 32, 16, KvDtype::F32).unwrap();
    let p = 16;
    let layout = KvLayout::new(shape, p, 128 * p as usize).unwrap();
    let mut seed = SplitMix64::new(5);
    let src = kv_pool::testing::random_host_store(layout, &mut seed);
    let pages: Vec<Page> = (1..=128).map(Page).collect();
    let slots = slots_of(&pages, p);
    let mut host = pool(&layout, 128, HostLayout::PageFirst);
    host.copy_from_store(&src, &slots, &slots).unwrap();
    let dst = LockedStoreRows::new(HostKvStore::new(layout).unwrap());
    let mut c = HiCacheController::with_device_rows(Arc::new(dst.clone()), host, None).unwrap();
    c.load(&slots, &slots);
    let gate = c.handle().start_loads();
    let rb = shape.row_bytes(KvBuffer::Key);
    for layer in 0..shape.layers as usize {
        gate.wait_layer(layer).unwrap();
        for &b in shape.buffers() {
            let mut got = vec![0u8; slots.len() * rb];
            let mut want = vec![0u8; slots.len() * rb];
            dst.store().read_raw(layer, b, &slots, &mut got).unwrap();
            src.read_raw(layer, b, &slots, &mut want).unwrap();
            assert!(got == want, "layer {layer} {} not loaded", b.name());
        }
    }
    assert_eq!(poll_n(&mut c, 1)[0].outcome, AckOutcome::Done);
}

/// A handle whose device fails from layer `fail_from` on (a lost device on wgpu), or panics
/// there (`panics`: a bug in a handle).
struct FailingRows {
    inner: LockedStoreRows<HostKvStore>,
    fail_from: usize,
    panics: bool,
    calls: AtomicUsize,
}

impl FailingRows {
    fn check(&self, layer: usize) -> kv_pool::Result<()> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if layer >= self.fail_from {
            assert!(!self.panics, "a bug at layer {layer}");
            return Err(KvPoolError::Device(format!("device lost at layer {layer}")));
        }
        Ok(())
    }
}

impl DeviceKvRows for FailingRows {
    fn layout(&self) -> &KvLayout {
        self.inner.layout()
    }

    fn read_rows(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        out: &mut [u8],
    ) -> kv_pool::Result<()> {
        self.check(layer)?;
        self.inner.read_rows(layer, buffer, slots, out)
    }

    fn write_rows(
        &self,
        layer: usize,
        buffer: KvBuffer,
        slots: &[Slot],
        bytes: &[u8],
    ) -> kv_pool::Result<()> {
        self.check(layer)?;
        self.inner.write_rows(layer, buffer, slots, bytes)
    }
}

#[test]
fn a_failing_device_fails_the_acks_and_the_pass_from_its_layer() {
    let shape = KvShape::mha(3, 4, 4, 2, KvDtype::F16).unwrap();
    let layout = KvLayout::new(shape, 4, 64).unwrap();
    let mut seed = SplitMix64::new(8);
    let rows = Arc::new(FailingRows {
        inner: LockedStoreRows::new(kv_pool::testing::random_host_store(layout, &mut seed)),
        fail_from: 1,
        panics: false,
        calls: AtomicUsize::new(0),
    });
    let mut c = HiCacheController::with_device_rows(
        rows.clone(),
        pool(&layout, 8, HostLayout::LayerFirst),
        None,
    )
    .unwrap();
    let s: Vec<Slot> = (4..12).map(Slot).collect();
    let w = c.write(&s, &s);
    let l = c.load(&s, &s);
    let gate = c.handle().start_loads();
    // Layer 1 failed: the pass fails there and at every later layer (and, once the failure
    // is known, at every layer: the pass cannot use the batch).
    let err = gate.wait_layer(1).unwrap_err();
    assert!(err.contains("device lost at layer 1"), "{err}");
    assert!(gate.wait_layer(2).is_err());
    let acks = poll_n(&mut c, 2);
    for a in &acks {
        assert!(a.op == w || a.op == l);
        assert!(
            matches!(&a.outcome, AckOutcome::Failed(r) if r.contains("device lost")),
            "{a:?}"
        );
    }
    // The copy stopped at the failing layer: layer 0 and layer 1 once each, per direction
    // (K and V of layer 0, then K of layer 1).
    assert_eq!(rows.calls.load(Ordering::Relaxed), 6);
}

#[test]
fn a_panicking_copy_fails_its_batch_and_the_thread_goes_on() {
    let shape = KvShape::mha(2, 4, 4, 2, KvDtype::F16).unwrap();
    let layout = KvLayout::new(shape, 4, 64).unwrap();
    let mut seed = SplitMix64::new(10);
    let rows = Arc::new(FailingRows {
        inner: LockedStoreRows::new(kv_pool::testing::random_host_store(layout, &mut seed)),
        fail_from: 1,
        panics: true,
        calls: AtomicUsize::new(0),
    });
    let mut c = HiCacheController::with_device_rows(
        rows.clone(),
        pool(&layout, 8, HostLayout::PageFirst),
        None,
    )
    .unwrap();
    let s: Vec<Slot> = (4..8).map(Slot).collect();
    let l = c.load(&s, &s);
    let gate = c.handle().start_loads();
    let err = gate.wait_layer(1).unwrap_err();
    assert!(err.contains("the copy panicked: a bug at layer 1"), "{err}");
    let a = &poll_n(&mut c, 1)[0];
    assert_eq!(a.op, l);
    assert!(
        matches!(&a.outcome, AckOutcome::Failed(r) if r.contains("panicked")),
        "{a:?}"
    );
    // The IO thread still runs: a write is copied, waited for and acknowledged.
    let w = c.write(&s, &s);
    c.wait(w);
    let a = &poll_n(&mut c, 1)[0];
    assert_eq!(a.op, w);
}

#[test]
fn copies_queued_after_stop_io_fail_at_once_and_wait_returns() {
    let shape = KvShape::mha(2, 4, 4, 2, KvDtype::F16).unwrap();
    let layout = KvLayout::new(shape, 4, 64).unwrap();
    let rows = LockedStoreRows::new(HostKvStore::new(layout).unwrap());
    let mut c = HiCacheController::with_device_rows(
        Arc::new(rows),
        pool(&layout, 8, HostLayout::LayerFirst),
        None,
    )
    .unwrap();
    let s: Vec<Slot> = (4..8).map(Slot).collect();
    let before = c.write(&s, &s);
    c.handle().stop_io();
    let w = c.write(&s, &s);
    let l = c.load(&s, &s);
    c.wait(w);
    c.wait(l);
    assert_eq!(c.handle().start_loads().wait_layer(1), Ok(()));
    let acks = poll_n(&mut c, 3);
    for a in acks {
        if a.op == before {
            assert_eq!(
                a.outcome,
                AckOutcome::Done,
                "queued before the stop: copied"
            );
        } else {
            assert!(
                matches!(&a.outcome, AckOutcome::Failed(r) if r.contains("has stopped")),
                "{a:?}"
            );
        }
    }
}
