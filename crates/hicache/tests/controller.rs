//! `HiCacheController`: bytes land exactly (every host layout, MHA / MLA / DoubleSparse, P 1
//! and 16), the layer gate orders a pass after its loads, L3 operations through a mock store
//! (and a failing one), and every ack arrives exactly once, in queue order per kind.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

mod common;

use common::{packed, pick_pages, poll_n, pool_packed, shapes, slots_of};
use hicache::controller::{ControllerError, HiCacheController, BATCH_PAGES};
use hicache::storage::{HiCacheStorage, StorageError, StorageStats};
use kv_pool::{
    Ack, AckOutcome, CacheController, HostKvPool, HostKvStore, HostLayout, KvDtype, KvLayout,
    KvShape, KvStore, LayerWait, OpId, Page, PageKey, Slot, SplitMix64, TierOpKind,
};

/// # Safety
/// `store` must outlive the controller and stay untouched while operations are in flight.
unsafe fn controller(
    store: &HostKvStore,
    host_pages: usize,
    layout: HostLayout,
    storage: Option<Arc<dyn HiCacheStorage>>,
) -> HiCacheController {
    let l = store.layout();
    let pool = HostKvPool::new(
        l.shape,
        l.page_size,
        host_pages * l.page_size as usize,
        layout,
    )
    .unwrap();
    // SAFETY: the caller's contract.
    unsafe { HiCacheController::new(store, pool, storage) }.unwrap()
}

#[test]
fn bytes_moved_device_to_host_to_device_land_exactly() {
    let mut seed = SplitMix64::new(21);
    for shape in shapes() {
        for p in [1u32, 16] {
            let layout = KvLayout::new(shape, p, 24 * p as usize).unwrap();
            let src = kv_pool::testing::random_host_store(layout, &mut seed);
            let dst = HostKvStore::new(layout).unwrap();
            for hl in HostLayout::ALL {
                // SAFETY: `src` and `dst` outlive the controllers (dropped at the end of the
                // iteration) and are read only after the acks.
                let mut c = unsafe { controller(&src, 32, hl, None) };
                let n = 1 + seed.below(12);
                let dpages = pick_pages(n, 24, &mut seed);
                let hpages = pick_pages(n, 32, &mut seed);
                // Two writes between polls: one merged batch.
                let (d, h) = (slots_of(&dpages, p), slots_of(&hpages, p));
                let split = d.len() / 2;
                c.write(&d[..split], &h[..split]);
                c.write(&d[split..], &h[split..]);
                let acks = poll_n(&mut c, 2);
                assert!(acks.iter().all(|a| a.outcome == AckOutcome::Done));
                assert_eq!(
                    pool_packed(c.host_pool(), &hpages),
                    packed(&src, &dpages),
                    "{hl}"
                );
                drop(c);
                // Load into another store (new controller over `dst`), layer by layer.
                let pool = {
                    let mut pool = HostKvPool::new(shape, p, 32 * p as usize, hl).unwrap();
                    pool.copy_from_store(&src, &d, &h).unwrap();
                    pool
                };
                // SAFETY: as above.
                let mut c = unsafe { HiCacheController::new(&dst, pool, None) }.unwrap();
                let tpages = pick_pages(n, 24, &mut seed);
                let op = c.load(&h, &slots_of(&tpages, p));
                let gate = c.handle().start_loads();
                for layer in 0..shape.layers as usize {
                    gate.wait_layer(layer).unwrap();
                }
                // A layer past the last waits for the whole batch.
                gate.wait_layer(usize::MAX).unwrap();
                c.wait(op);
                assert_eq!(poll_n(&mut c, 1)[0].outcome, AckOutcome::Done);
                drop(c);
                assert_eq!(packed(&dst, &tpages), packed(&src, &dpages), "{hl} P={p}");
            }
        }
    }
}

#[test]
fn a_pass_waiting_per_layer_sees_each_layer_loaded() {
    // Many layers and pages, so the copy takes long enough for the gate to matter.
    let shape = KvShape::mha(4, 32, 32, 16, KvDtype::F32).unwrap();
    let p = 16;
    let layout = KvLayout::new(shape, p, 128 * p as usize).unwrap();
    let mut seed = SplitMix64::new(4);
    let mut src = kv_pool::testing::random_host_store(layout, &mut seed);
    let pages: Vec<Page> = (1..=128).map(Page).collect();
    let slots = slots_of(&pages, p);
    let mut pool = HostKvPool::new(shape, p, 128 * p as usize, HostLayout::LayerFirst).unwrap();
    pool.copy_from_store(&src, &slots, &slots).unwrap();
    let want = packed(&src, &pages);
    // Clear the device rows, then load them back while "computing" layer by layer.
    src = HostKvStore::new(layout).unwrap();
    // SAFETY: `src` outlives the controller; it is read per layer only after the gate
    // released that layer (each layer is its own buffer, which the IO thread no longer writes).
    let mut c = unsafe { HiCacheController::new(&src, pool, None) }.unwrap();
    c.load(&slots, &slots);
    let gate = c.handle().start_loads();
    let rb = shape.row_bytes(kv_pool::KvBuffer::Key);
    for layer in 0..shape.layers as usize {
        gate.wait_layer(layer).unwrap();
        for &b in shape.buffers() {
            let mut got = vec![0u8; slots.len() * rb];
            src.read_raw(layer, b, &slots, &mut got).unwrap();
            assert!(got.iter().any(|&x| x != 0), "layer {layer} not loaded");
        }
    }
    assert_eq!(poll_n(&mut c, 1)[0].outcome, AckOutcome::Done);
    drop(c);
    assert_eq!(packed(&src, &pages), want);
}

#[test]
fn refused_slots_fail_their_ack_and_the_pass() {
    let shape = KvShape::mha(1, 4, 4, 2, KvDtype::F16).unwrap();
    let store = HostKvStore::new(KvLayout::new(shape, 4, 16).unwrap()).unwrap();
    // SAFETY: `store` outlives the controller and is not touched.
    let mut c = unsafe { controller(&store, 4, HostLayout::PageFirst, None) };
    let good: Vec<Slot> = (4..8).map(Slot).collect();
    let w = c.write(&good, &(100..104).map(Slot).collect::<Vec<_>>());
    let l1 = c.load(&good, &good);
    let l2 = c.load(&good, &good[..3]);
    let gate = c.handle().start_loads();
    let err = gate.wait_layer(0).unwrap_err();
    assert!(err.contains("3 device slots for 4 host slots"), "{err}");
    let acks = poll_n(&mut c, 3);
    let by_op: HashMap<OpId, &AckOutcome> = acks.iter().map(|a| (a.op, &a.outcome)).collect();
    assert!(matches!(by_op[&w], AckOutcome::Failed(r) if r.contains("host slot 100")));
    assert_eq!(by_op[&l1], &AckOutcome::Done);
    assert!(matches!(by_op[&l2], AckOutcome::Failed(_)));
    // A later pass with no loads is not failed by the old batch.
    assert_eq!(c.handle().start_loads().wait_layer(1), Ok(()));
}

#[test]
fn acks_arrive_exactly_once_in_queue_order_per_kind() {
    let shape = KvShape::mha(1, 8, 8, 4, KvDtype::Bf16).unwrap();
    let layout = KvLayout::new(shape, 4, 256).unwrap();
    let mut seed = SplitMix64::new(9);
    let store = kv_pool::testing::random_host_store(layout, &mut seed);
    let storage: Arc<dyn HiCacheStorage> = Arc::new(MockStorage::new(layout.page_bytes()));
    // SAFETY: `store` outlives the controller; the ops only read it (writes, backups).
    let mut c = unsafe { controller(&store, 64, HostLayout::PageFirstDirect, Some(storage)) };
    let mut issued: Vec<(OpId, TierOpKind)> = Vec::new();
    let mut got: Vec<Ack> = Vec::new();
    for step in 0..200 {
        let dp = pick_pages(1 + seed.below(4), 64, &mut seed);
        let hp = pick_pages(dp.len(), 64, &mut seed);
        let keys: Vec<PageKey> = (0..dp.len()).map(|_| [seed.next_u64() as u8; 32]).collect();
        let (d, h) = (slots_of(&dp, 4), slots_of(&hp, 4));
        let (op, kind) = match seed.below(4) {
            0 => (c.write(&d, &h), TierOpKind::Write),
            1 => (c.load(&h, &d[..d.len() - step % 2]), TierOpKind::Load),
            2 => (c.query(&keys), TierOpKind::Query),
            _ => (c.backup(&h, &keys), TierOpKind::Backup),
        };
        issued.push((op, kind));
        if seed.below(3) == 0 {
            got.extend(c.poll_acks());
        }
        if seed.below(20) == 0 {
            c.wait(op);
        }
    }
    got.extend(poll_n(&mut c, issued.len() - got.len()));
    let mut seen = HashSet::new();
    for a in &got {
        assert!(seen.insert(a.op), "{} acked twice", a.op);
    }
    let kinds: HashMap<OpId, TierOpKind> = issued.iter().copied().collect();
    assert_eq!(seen.len(), issued.len());
    for kind in [
        TierOpKind::Write,
        TierOpKind::Load,
        TierOpKind::Query,
        TierOpKind::Backup,
    ] {
        let order: Vec<OpId> = got
            .iter()
            .filter(|a| a.kind == kind)
            .map(|a| a.op)
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{kind:?}: {order:?}");
        assert!(order.iter().all(|op| kinds[op] == kind));
    }
    assert_eq!(c.in_flight(), 0);
}

/// An in-memory L3 store; `hold` makes `batch_get` wait until released.
struct MockStorage {
    pages: Mutex<HashMap<PageKey, Vec<u8>>>,
    page_bytes: usize,
    hold: Mutex<bool>,
    released: Condvar,
    gets: Mutex<usize>,
}

impl MockStorage {
    fn new(page_bytes: usize) -> Self {
        MockStorage {
            pages: Mutex::new(HashMap::new()),
            page_bytes,
            hold: Mutex::new(false),
            released: Condvar::new(),
            gets: Mutex::new(0),
        }
    }

    fn set_hold(&self, hold: bool) {
        *self.hold.lock().unwrap() = hold;
        self.released.notify_all();
    }
}

impl HiCacheStorage for MockStorage {
    fn name(&self) -> &'static str {
        "mock"
    }
    fn page_bytes(&self) -> usize {
        self.page_bytes
    }
    fn batch_exists(&self, keys: &[PageKey]) -> usize {
        let m = self.pages.lock().unwrap();
        keys.iter().take_while(|k| m.contains_key(*k)).count()
    }
    fn batch_get(&self, keys: &[PageKey], out: &mut [u8]) -> Result<usize, StorageError> {
        *self.gets.lock().unwrap() += 1;
        let mut h = self.hold.lock().unwrap();
        while *h {
            h = self.released.wait(h).unwrap();
        }
        drop(h);
        let m = self.pages.lock().unwrap();
        let mut n = 0;
        for (i, k) in keys.iter().enumerate() {
            let Some(page) = m.get(k) else { break };
            out[i * self.page_bytes..(i + 1) * self.page_bytes].copy_from_slice(page);
            n += 1;
        }
        Ok(n)
    }
    fn batch_set(&self, keys: &[PageKey], data: &[u8]) -> Result<(), StorageError> {
        let mut m = self.pages.lock().unwrap();
        for (k, page) in keys.iter().zip(data.chunks(self.page_bytes)) {
            m.insert(*k, page.to_vec());
        }
        Ok(())
    }
    fn clear(&self) -> Result<(), StorageError> {
        self.pages.lock().unwrap().clear();
        Ok(())
    }
    fn stats(&self) -> StorageStats {
        StorageStats::default()
    }
}

/// A store that is always down.
struct FailingStorage(usize);

impl HiCacheStorage for FailingStorage {
    fn name(&self) -> &'static str {
        "failing"
    }
    fn page_bytes(&self) -> usize {
        self.0
    }
    fn batch_exists(&self, _: &[PageKey]) -> usize {
        0
    }
    fn batch_get(&self, _: &[PageKey], _: &mut [u8]) -> Result<usize, StorageError> {
        Err(StorageError::Backend {
            backend: "failing",
            reason: "down".into(),
        })
    }
    fn batch_set(&self, _: &[PageKey], _: &[u8]) -> Result<(), StorageError> {
        Err(StorageError::Backend {
            backend: "failing",
            reason: "down".into(),
        })
    }
    fn clear(&self) -> Result<(), StorageError> {
        Ok(())
    }
    fn stats(&self) -> StorageStats {
        StorageStats::default()
    }
}

fn key(i: usize) -> PageKey {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&(i as u64).to_le_bytes());
    k
}

#[test]
fn storage_backup_query_prefetch_through_a_mock_store() {
    // P = 1 and 300 pages: more than two storage batches of 128.
    let shape = KvShape::mla(6, 2, 2, KvDtype::Bf16).unwrap();
    let layout = KvLayout::new(shape, 1, 320).unwrap();
    let mut seed = SplitMix64::new(17);
    let store = kv_pool::testing::random_host_store(layout, &mut seed);
    let mock = Arc::new(MockStorage::new(layout.page_bytes()));
    let storage: Arc<dyn HiCacheStorage> = mock.clone();
    // SAFETY: `store` outlives the controller and is only read.
    let mut c = unsafe { controller(&store, 640, HostLayout::PageFirst, Some(storage)) };
    assert!(c.storage_enabled());
    let n = 300;
    let dpages: Vec<Page> = (1..=n as u32).map(Page).collect();
    let hpages: Vec<Page> = (1..=n as u32).map(Page).collect();
    let keys: Vec<PageKey> = (0..n).map(key).collect();
    c.write(&slots_of(&dpages, 1), &slots_of(&hpages, 1));
    poll_n(&mut c, 1);
    let b = c.backup(&slots_of(&hpages, 1), &keys);
    c.wait(b);
    assert_eq!(poll_n(&mut c, 1)[0].outcome, AckOutcome::Done);
    let want = packed(&store, &dpages);
    {
        let m = mock.pages.lock().unwrap();
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(
                m[k],
                want[i * layout.page_bytes()..(i + 1) * layout.page_bytes()]
            );
        }
    }
    // Query: the leading hits (a hole at 250 ends the prefix).
    let mut asked = keys.clone();
    asked[250] = key(9999);
    let q = c.query(&asked);
    c.wait(q);
    assert_eq!(poll_n(&mut c, 1)[0].outcome, AckOutcome::Found(250));
    // Prefetch into other host pages: the leading 250 land, byte for byte.
    let other: Vec<Page> = (301..=600).map(Page).collect();
    let pf = c.prefetch(&asked, &slots_of(&other, 1));
    c.wait(pf);
    assert_eq!(c.prefetch_progress(pf), 250);
    assert_eq!(poll_n(&mut c, 1)[0].outcome, AckOutcome::Fetched(250));
    assert_eq!(
        pool_packed(c.host_pool(), &other[..250]),
        want[..250 * layout.page_bytes()]
    );
    // Cancel mid-way: the first batch is held, cancelled, released: one batch lands.
    mock.set_hold(true);
    let gets = *mock.gets.lock().unwrap();
    let pf = c.prefetch(&keys, &slots_of(&other, 1));
    while *mock.gets.lock().unwrap() == gets {
        std::thread::sleep(Duration::from_millis(1));
    }
    c.cancel_prefetch(pf);
    mock.set_hold(false);
    c.wait(pf);
    assert_eq!(
        poll_n(&mut c, 1)[0].outcome,
        AckOutcome::Fetched(BATCH_PAGES)
    );
    // Slots that are not whole pages are refused in turn.
    let bad = c.backup(&[Slot(0)], &keys[..1]);
    let acks = poll_n(&mut c, 1);
    assert_eq!(acks[0].op, bad);
    assert!(
        matches!(&acks[0].outcome, AckOutcome::Failed(r) if r.contains("not one allocatable page"))
    );
}

#[test]
fn a_failing_store_is_a_miss_never_a_panic() {
    let shape = KvShape::mha(1, 4, 4, 1, KvDtype::F32).unwrap();
    let layout = KvLayout::new(shape, 2, 8).unwrap();
    let store = HostKvStore::new(layout).unwrap();
    let storage: Arc<dyn HiCacheStorage> = Arc::new(FailingStorage(layout.page_bytes()));
    // SAFETY: `store` outlives the controller and is not touched.
    let mut c = unsafe { controller(&store, 8, HostLayout::LayerFirst, Some(storage)) };
    let h: Vec<Slot> = (2..6).map(Slot).collect();
    let b = c.backup(&h, &[key(1), key(2)]);
    let q = c.query(&[key(1), key(2)]);
    let p = c.prefetch(&[key(1), key(2)], &h);
    let acks: HashMap<OpId, AckOutcome> = poll_n(&mut c, 3)
        .into_iter()
        .map(|a| (a.op, a.outcome))
        .collect();
    assert!(matches!(&acks[&b], AckOutcome::Failed(r) if r.contains("down")));
    assert_eq!(acks[&q], AckOutcome::Found(0));
    assert_eq!(acks[&p], AckOutcome::Fetched(0));
    // Without storage: L3 calls complete at once as misses.
    // SAFETY: as above.
    let mut c = unsafe { controller(&store, 8, HostLayout::LayerFirst, None) };
    assert!(!c.storage_enabled());
    c.query(&[key(1)]);
    c.prefetch(&[key(1)], &h[..2]);
    c.backup(&h[..2], &[key(1)]);
    let outcomes: Vec<AckOutcome> = c.poll_acks().into_iter().map(|a| a.outcome).collect();
    assert_eq!(
        outcomes[..2],
        [AckOutcome::Found(0), AckOutcome::Fetched(0)]
    );
    assert!(matches!(outcomes[2], AckOutcome::Failed(_)));
}

#[test]
fn mismatched_pool_or_storage_is_refused() {
    let shape = KvShape::mha(1, 4, 4, 1, KvDtype::F32).unwrap();
    let store = HostKvStore::new(KvLayout::new(shape, 2, 8).unwrap()).unwrap();
    let pool = HostKvPool::new(shape, 4, 8, HostLayout::LayerFirst).unwrap();
    // SAFETY: `store` outlives the (refused) controller.
    let err = unsafe { HiCacheController::new(&store, pool, None) }.unwrap_err();
    assert!(
        matches!(err, ControllerError::Mismatch(ref m) if m.contains("page size 4")),
        "{err}"
    );
    let pool = HostKvPool::new(shape, 2, 8, HostLayout::LayerFirst).unwrap();
    let storage: Arc<dyn HiCacheStorage> = Arc::new(FailingStorage(3));
    // SAFETY: as above.
    let err = unsafe { HiCacheController::new(&store, pool, Some(storage)) }.unwrap_err();
    assert!(err.to_string().contains("pages of 3 bytes"), "{err}");
}

#[test]
fn dropping_with_operations_in_flight_joins_cleanly() {
    let shape = KvShape::mha(2, 16, 16, 8, KvDtype::F32).unwrap();
    let layout = KvLayout::new(shape, 4, 1024).unwrap();
    let store = HostKvStore::new(layout).unwrap();
    let mock = Arc::new(MockStorage::new(layout.page_bytes()));
    let storage: Arc<dyn HiCacheStorage> = mock.clone();
    // SAFETY: `store` outlives the controller (dropped inside this scope).
    let mut c = unsafe { controller(&store, 256, HostLayout::PageFirst, Some(storage)) };
    let s: Vec<Slot> = (4..1028).map(Slot).collect();
    c.write(&s, &s);
    c.load(&s, &s);
    let keys: Vec<PageKey> = (0..256).map(key).collect();
    c.query(&keys);
    let handle = c.handle();
    drop(c);
    // The handle outlives the controller: its gate never blocks.
    assert_eq!(handle.start_loads().wait_layer(7), Ok(()));
}
