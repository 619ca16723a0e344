//! RadixCache with a host tier (SGLang's HiRadixCache): each write policy's story rendered as a
//! snapshot (insert, hit, backup, ack, eviction → demotion, a match reporting a host hit,
//! load-back, ack), write-back's synchronous backup and dropped subtree, host eviction order,
//! revival on insert, L3 backup then a fresh tree prefetching it, an unreachable store; a
//! proptest over random operations with both partitions checked after every step and tags
//! proving load-backs land the right rows; and the exported `check_prefix_cache` suite on
//! tiered caches.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use kv_pool::testing::{ImmediateController, LoggedOp};
use kv_pool::tier::{Ack, CacheController, OpId, PageKey};
use kv_pool::{Allocator, OwnershipCheck, PagedAllocator, Slot};
use radix_cache::testing;
use radix_cache::tiers::{HiCacheConfig, PrefetchPolicy, TierStats, WritePolicy};
use radix_cache::{BuiltinPolicy, InsertOptions, PrefixCache, RadixCache};

/// An [`ImmediateController`] the test keeps a handle on while the cache owns the box.
#[derive(Clone)]
struct Shared(Arc<Mutex<ImmediateController>>);

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, ImmediateController> {
        self.0.lock().unwrap()
    }
}

impl CacheController for Shared {
    fn write(&mut self, device: &[Slot], host: &[Slot]) -> OpId {
        self.lock().write(device, host)
    }
    fn load(&mut self, host: &[Slot], device: &[Slot]) -> OpId {
        self.lock().load(host, device)
    }
    fn wait(&mut self, op: OpId) {
        self.lock().wait(op)
    }
    fn poll_acks(&mut self) -> Vec<Ack> {
        self.lock().poll_acks()
    }
    fn storage_enabled(&self) -> bool {
        self.lock().storage_enabled()
    }
    fn backup(&mut self, host: &[Slot], keys: &[PageKey]) -> OpId {
        self.lock().backup(host, keys)
    }
    fn query(&mut self, keys: &[PageKey]) -> OpId {
        self.lock().query(keys)
    }
    fn prefetch(&mut self, keys: &[PageKey], host: &[Slot]) -> OpId {
        self.lock().prefetch(keys, host)
    }
    fn prefetch_progress(&self, op: OpId) -> usize {
        self.lock().prefetch_progress(op)
    }
    fn cancel_prefetch(&mut self, op: OpId) {
        self.lock().cancel_prefetch(op)
    }
}

/// Every storage key the controller was asked to back up, in order.
fn backup_keys(ctl: &Shared) -> Vec<PageKey> {
    ctl.lock()
        .log
        .iter()
        .filter_map(|(_, op)| match op {
            LoggedOp::Backup { keys, .. } => Some(keys.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn letter(t: u32) -> String {
    char::from(b'A' + (t as u8 - 1)).to_string()
}

fn toks(s: &str) -> Vec<u32> {
    s.bytes().map(|b| (b - b'A' + 1) as u32).collect()
}

fn slots_str(s: &[Slot]) -> String {
    s.iter()
        .map(|s| s.0.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A tiered cache, its device pool and its controller, logging every step.
struct Story {
    cache: RadixCache,
    alloc: PagedAllocator,
    ctl: Shared,
    logged: usize,
    log: String,
}

impl Story {
    fn new(page: u32, device: usize, cfg: HiCacheConfig, ctl: ImmediateController) -> Story {
        let ctl = Shared(Arc::new(Mutex::new(ctl)));
        Story::with_controller(page, device, cfg, ctl)
    }

    fn with_controller(page: u32, device: usize, cfg: HiCacheConfig, ctl: Shared) -> Story {
        let logged = ctl.lock().log.len();
        let cache = RadixCache::new(page, BuiltinPolicy::Lru)
            .with_events(true)
            .with_host_tier(cfg, Box::new(ctl.clone()))
            .unwrap();
        Story {
            cache,
            alloc: PagedAllocator::new(device, page).unwrap(),
            ctl,
            logged,
            log: String::new(),
        }
    }

    /// Inserts `key` with fresh device slots for what is not on device; frees the duplicates.
    fn insert(&mut self, key: &str) -> Vec<Slot> {
        let key = toks(key);
        let mut slots = Vec::new();
        let m = self.cache.match_prefix(&key, None, &mut slots);
        let mut fresh = Vec::new();
        self.alloc.alloc(key.len() - m.len, &mut fresh).unwrap();
        // Tag the fresh rows as the model would write them.
        for (k, s) in fresh.iter().enumerate() {
            self.ctl
                .lock()
                .set_device_tag(*s, tag(&key[..m.len + k + 1]));
        }
        slots.extend_from_slice(&fresh);
        let r = self
            .cache
            .insert(&key, None, &slots, InsertOptions::default())
            .unwrap();
        assert_eq!(r.prefix_len, m.len, "prefix_len counts device tokens only");
        slots
    }

    fn acks(&mut self) {
        self.cache.check_hicache_events().unwrap();
    }

    fn check(&self, what: &str) {
        self.cache
            .check_invariants()
            .unwrap_or_else(|e| panic!("after {what}: {e}"));
        let mut check = OwnershipCheck::new(&self.alloc);
        self.cache.claim_ownership(&mut check);
        check
            .finish()
            .unwrap_or_else(|v| panic!("after {what}: {v}"));
        assert_eq!(
            self.alloc.size() - self.alloc.available_size(),
            self.cache.total_size(),
            "after {what}"
        );
    }

    fn step(&mut self, what: &str) {
        self.check(what);
        let _ = writeln!(self.log, "## {what}");
        let ctl = self.ctl.lock();
        for (op, logged) in &ctl.log[self.logged..] {
            let line = match logged {
                LoggedOp::Write { device, host } => {
                    format!("write d[{}] -> h[{}]", slots_str(device), slots_str(host))
                }
                LoggedOp::Load { host, device } => {
                    format!("load h[{}] -> d[{}]", slots_str(host), slots_str(device))
                }
                LoggedOp::Backup { host, keys } => {
                    format!("backup h[{}] ({} keys)", slots_str(host), keys.len())
                }
                LoggedOp::Query { keys } => format!("query {} keys", keys.len()),
                LoggedOp::Prefetch { keys, host } => {
                    format!("prefetch {} keys -> h[{}]", keys.len(), slots_str(host))
                }
            };
            let _ = writeln!(self.log, "{op}: {line}");
        }
        drop(ctl);
        self.logged = self.ctl.lock().log.len();
        let _ = writeln!(self.log, "{}", self.cache.render_with(&letter));
    }
}

/// A row's tag: a hash of the tokens through it (what the model would have computed there).
fn tag(prefix: &[u32]) -> u64 {
    prefix.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
        (h ^ t as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn cfg(policy: WritePolicy, host_slots: usize) -> HiCacheConfig {
    HiCacheConfig {
        write_policy: policy,
        host_slots,
        load_back_threshold: 2,
        prefetch_threshold: 4,
        ..HiCacheConfig::default()
    }
}

/// The write-through story at `policy`: backup on the threshold, ack, demotion, host hit,
/// load-back, ack.
fn write_through_story(policy: WritePolicy) -> String {
    let mut s = Story::new(
        2,
        32,
        cfg(policy, 32),
        ImmediateController::with_tags(34, 34, 2),
    );
    s.insert("ABCD");
    s.step("insert ABCD");
    s.insert("ABCD");
    s.step("insert ABCD again (a hit)");
    s.acks();
    s.step("acks");
    s.insert("ABEF");
    s.step("insert ABEF (split)");
    s.insert("ABEF");
    s.acks();
    s.step("insert ABEF again, acks");
    let freed = s.cache.evict(8, &mut s.alloc).unwrap();
    s.step(&format!("evict 8: freed {freed}"));
    let mut out = Vec::new();
    let m = s.cache.match_prefix(&toks("ABCDX"), None, &mut out);
    let _ = writeln!(
        s.log,
        "match ABCDX: len={} host_hit_len={} last_node={} last_host_node={}\n",
        m.len, m.host_hit_len, m.last_node, m.last_host_node
    );
    let lb = s
        .cache
        .init_load_back(m.last_host_node, &mut out, &mut s.alloc, 1000)
        .unwrap();
    assert_eq!(lb.loaded, m.host_hit_len);
    let _ = writeln!(
        s.log,
        "load-back: loaded={} last_node={} out=[{}]\n",
        lb.loaded,
        lb.last_node,
        slots_str(&out)
    );
    // The rows landed where the tree now says they are.
    let ctl = s.ctl.lock();
    for (k, slot) in out.iter().enumerate() {
        assert_eq!(
            ctl.device[slot.index()],
            tag(&toks("ABCD")[..k + 1]),
            "row {k}"
        );
    }
    drop(ctl);
    s.step("load-back ABCD");
    s.acks();
    s.step("acks");
    s.log
}

#[test]
fn snapshot_write_through() {
    insta::assert_snapshot!(write_through_story(WritePolicy::WriteThrough));
}

#[test]
fn snapshot_write_through_selective() {
    insta::assert_snapshot!(write_through_story(WritePolicy::WriteThroughSelective));
}

#[test]
fn snapshot_write_back_waits_then_drops_without_host_room() {
    // Host room for 4 tokens only.
    let mut s = Story::new(
        2,
        32,
        cfg(WritePolicy::WriteBack, 4),
        ImmediateController::with_tags(34, 6, 2),
    );
    s.insert("ABCD");
    s.insert("ABEF");
    s.step("insert ABCD, ABEF: write-back copies nothing");
    let freed = s.cache.evict(2, &mut s.alloc).unwrap();
    s.step(&format!(
        "evict 2: a synchronous copy, then demotion (freed {freed})"
    ));
    s.acks();
    s.step("acks");
    let freed = s.cache.evict(2, &mut s.alloc).unwrap();
    s.step(&format!(
        "evict 2: EF copied into the last free host page, then demoted (freed {freed})"
    ));
    s.acks();
    s.insert("GH");
    s.insert("GHIJ");
    s.step("insert GH, GHIJ");
    // AB and IJ find host room by host eviction (CD, EF) and stay pinned until their acks;
    // GH then finds none: it is dropped with IJ, whose host pages go at IJ's ack.
    let freed = s.cache.evict(100, &mut s.alloc).unwrap();
    s.step(&format!(
        "evict everything (freed {freed}): GH dropped with IJ"
    ));
    s.acks();
    s.step("acks: IJ's orphaned host pages freed");
    let st = s.cache.tier_stats().unwrap();
    let _ = writeln!(s.log, "{st:#?}");
    insta::assert_snapshot!(s.log);
}

#[test]
fn snapshot_host_eviction_order_and_revival() {
    let mut s = Story::new(
        1,
        32,
        cfg(WritePolicy::WriteThrough, 8),
        ImmediateController::with_tags(33, 9, 1),
    );
    for key in ["AB", "CD", "EF"] {
        s.insert(key);
        s.acks();
    }
    // Touch CD so AB is the least recently used.
    let mut out = Vec::new();
    s.cache.match_prefix(&toks("CD"), None, &mut out);
    let freed = s.cache.evict(6, &mut s.alloc).unwrap();
    s.step(&format!(
        "three leaves backed up, all demoted (freed {freed})"
    ));
    let n = s.cache.evict_host(1).unwrap();
    s.step(&format!(
        "evict_host(1): freed {n} (AB, least recently used)"
    ));
    // The host has 8 slots, 4 used: inserting GHIJK (5 tokens) backs it up after evicting EF.
    s.insert("GHIJK");
    s.acks();
    s.step("insert GHIJK: host eviction makes room for its backup (LRU: EF before CD)");
    let slots = s.insert("CDX");
    s.step(&format!(
        "insert CDX: CD revived with slots [{}] (prefix_len 0)",
        slots_str(&slots[..2])
    ));
    insta::assert_snapshot!(s.log);
}

#[test]
fn snapshot_storage_backup_then_prefetch_into_a_fresh_tree() {
    let ctl = Shared(Arc::new(Mutex::new(
        ImmediateController::with_tags(34, 34, 2).with_storage(),
    )));
    let mut s = Story::with_controller(2, 32, cfg(WritePolicy::WriteThrough, 32), ctl.clone());
    s.insert("ABCDEF");
    s.step("insert ABCDEF: write");
    s.acks();
    s.step("write ack: backup to storage, pinned");
    s.acks();
    s.step("backup ack: unpinned");
    let first = s.log;
    // A fresh tree (a restarted server) on the same store.
    let mut t = Story::with_controller(2, 32, cfg(WritePolicy::WriteThrough, 32), ctl);
    let key = toks("ABCDEFGH");
    t.cache.prefetch_from_storage(7, &key, None).unwrap();
    t.step("prefetch ABCDEFGH: query");
    t.acks();
    t.step("query ack: 3 pages hit, fetch them");
    assert!(
        t.cache.check_prefetch_progress(8, 0.0).unwrap(),
        "a request without a prefetch proceeds"
    );
    t.acks();
    t.step("prefetch ack");
    assert!(t.cache.check_prefetch_progress(7, 0.0).unwrap());
    t.step("progress: inserted host-only");
    let mut out = Vec::new();
    let m = t.cache.match_prefix(&key, None, &mut out);
    assert_eq!((m.len, m.host_hit_len), (0, 6));
    let lb = t
        .cache
        .init_load_back(m.last_host_node, &mut out, &mut t.alloc, 100)
        .unwrap();
    assert_eq!(lb.loaded, 6);
    {
        let ctl = t.ctl.lock();
        for (k, slot) in out.iter().enumerate() {
            assert_eq!(
                ctl.device[slot.index()],
                tag(&toks("ABCDEF")[..k + 1]),
                "row {k}"
            );
        }
    }
    t.step("load-back of the prefetched pages: rows as written by the first tree");
    t.acks();
    let st = t.cache.tier_stats().unwrap();
    assert_eq!(st.storage_hit_tokens, 6);
    insta::assert_snapshot!(format!("{first}\n# fresh tree\n{}", t.log));
}

#[test]
fn storage_down_is_a_miss() {
    let mut ctl = ImmediateController::with_tags(34, 34, 2).with_storage();
    ctl.storage_down = true;
    let mut s = Story::new(2, 32, cfg(WritePolicy::WriteThrough, 32), ctl);
    s.insert("ABCD");
    s.acks();
    s.acks();
    s.check("backup failed");
    assert_eq!(s.cache.tier_stats().unwrap().ops_failed, 1);
    let key = toks("WXYZWXYZ");
    s.cache.prefetch_from_storage(1, &key, None).unwrap();
    s.acks();
    assert!(s.cache.check_prefetch_progress(1, 0.0).unwrap());
    s.check("prefetch missed");
    let mut out = Vec::new();
    let m = s.cache.match_prefix(&key, None, &mut out);
    assert_eq!((m.len, m.host_hit_len), (0, 0));
    assert_eq!(s.cache.tier_stats().unwrap().storage_hit_tokens, 0);
}

#[test]
fn a_host_tier_is_refused_on_a_non_empty_cache_and_a_bad_size() {
    let mut c = RadixCache::new(2, BuiltinPolicy::Lru);
    c.insert(&[1, 2], None, &[Slot(2), Slot(3)], InsertOptions::default())
        .unwrap();
    assert!(c
        .with_host_tier(
            cfg(WritePolicy::WriteBack, 8),
            Box::new(ImmediateController::new())
        )
        .is_err());
    assert!(RadixCache::new(2, BuiltinPolicy::Lru)
        .with_host_tier(
            cfg(WritePolicy::WriteBack, 7),
            Box::new(ImmediateController::new())
        )
        .is_err());
}

#[test]
fn prefix_cache_suite_passes_on_tiered_caches() {
    for policy in WritePolicy::ALL {
        testing::check_prefix_cache(|page| {
            RadixCache::new(page, BuiltinPolicy::Lru)
                .with_events(true)
                .with_host_tier(
                    cfg(policy, 32 * page as usize),
                    Box::new(ImmediateController::new()),
                )
                .unwrap()
        });
    }
}

#[test]
fn prefetch_policies_decide_when_to_stop() {
    for (policy, expect_first) in [
        (PrefetchPolicy::BestEffort, true),
        (PrefetchPolicy::WaitComplete, false),
        (PrefetchPolicy::Timeout, false),
    ] {
        let ctl = ImmediateController::with_tags(34, 34, 2).with_storage();
        let mut c = HiCacheConfig {
            prefetch_policy: policy,
            ..cfg(WritePolicy::WriteThrough, 32)
        };
        c.prefetch_threshold = 2;
        let mut s = Story::new(2, 32, c, ctl);
        s.ctl
            .lock()
            .storage
            .as_mut()
            .unwrap()
            .insert([0; 32], vec![0, 0]);
        let key = toks("ABCD");
        s.cache.prefetch_from_storage(1, &key, None).unwrap();
        // The query is in flight: best effort gives up now, the others wait.
        assert_eq!(
            s.cache.check_prefetch_progress(1, 0.0).unwrap(),
            expect_first,
            "{policy}"
        );
        if policy == PrefetchPolicy::Timeout {
            assert!(s.cache.check_prefetch_progress(1, 100.0).unwrap());
        }
        s.acks();
        assert!(s.cache.check_prefetch_progress(1, 200.0).unwrap());
        s.acks();
        s.check(policy.as_str());
        s.cache.release_prefetch(1).unwrap();
        s.check("release");
    }
}

/// One operation of the tiered proptest; sequences index [`testing::base_sequences`].
#[derive(Debug, Clone)]
enum TierOp {
    Insert(usize, usize),
    /// As `Insert`, but the write-through copies it queues fail; the next poll (taken at once
    /// here) queues them again, and those land.
    InsertFailingWrites(usize, usize),
    /// Match, then load back what the match found on host (`quota`: the memory quota).
    MatchLoad(usize, usize, usize),
    /// As `MatchLoad`, but the load-back's copy fails; the next poll (taken at once here)
    /// queues it again, and that copy lands.
    MatchLoadFailing(usize, usize, usize),
    Evict(usize),
    EvictHost(usize),
    Lock(usize, usize),
    Unlock(usize),
    Acks,
    WriteBackPath(usize, usize),
    Prefetch(usize, usize),
    Progress(u64, u32),
    Release(u64),
    /// Evict everything evictable from both tiers (only storage remembers).
    Flush,
}

fn tier_op() -> impl proptest::strategy::Strategy<Value = TierOp> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0usize..6, 1usize..24).prop_map(|(b, l)| TierOp::Insert(b, l)),
        1 => (0usize..6, 1usize..24).prop_map(|(b, l)| TierOp::InsertFailingWrites(b, l)),
        3 => (0usize..6, 0usize..24, 0usize..30).prop_map(|(b, l, q)| TierOp::MatchLoad(b, l, q)),
        1 => (0usize..6, 0usize..24, 0usize..30)
            .prop_map(|(b, l, q)| TierOp::MatchLoadFailing(b, l, q)),
        2 => (1usize..30).prop_map(TierOp::Evict),
        1 => (1usize..20).prop_map(TierOp::EvictHost),
        1 => (0usize..6, 1usize..24).prop_map(|(b, l)| TierOp::Lock(b, l)),
        1 => (0usize..8).prop_map(TierOp::Unlock),
        3 => Just(TierOp::Acks),
        1 => (0usize..6, 1usize..24).prop_map(|(b, l)| TierOp::WriteBackPath(b, l)),
        1 => (0usize..6, 1usize..24).prop_map(|(b, l)| TierOp::Prefetch(b, l)),
        1 => (0u64..4, 0u32..4).prop_map(|(r, t)| TierOp::Progress(r, t)),
        1 => (0u64..4).prop_map(TierOp::Release),
        1 => Just(TierOp::Flush),
    ]
}

/// Runs `ops` on a tiered cache, checking both partitions after every step and that every
/// matched or loaded-back slot holds the row its prefix wrote.
fn run_tier_ops(
    page: u32,
    write: WritePolicy,
    prefetch: PrefetchPolicy,
    ops: &[TierOp],
) -> TierStats {
    let p = page as usize;
    let bases = testing::base_sequences();
    let config = HiCacheConfig {
        prefetch_policy: prefetch,
        prefetch_threshold: 2 * p,
        load_back_threshold: p,
        prefetch_timeout_base_s: 1.0,
        prefetch_max_host_share: 1.0,
        ..cfg(write, 24 * p)
    };
    let ctl = ImmediateController::with_tags(32 * p + p, 24 * p + p, page).with_storage();
    let mut s = Story::new(page, 32 * p, config, ctl);
    let mut locks = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        match *op {
            TierOp::Insert(b, l) | TierOp::InsertFailingWrites(b, l) => {
                let failing = matches!(op, TierOp::InsertFailingWrites(..));
                s.ctl.lock().writes_fail = failing;
                let key = &bases[b][..l];
                let mut slots = Vec::new();
                let m = s.cache.match_prefix(key, None, &mut slots);
                let need = (key.len() - m.len).div_ceil(p) * p;
                if s.alloc.available_size() < need {
                    let short = need - s.alloc.available_size();
                    s.cache.evict(short, &mut s.alloc).unwrap();
                }
                // Eviction may have taken matched nodes: match again.
                slots.clear();
                let m = s.cache.match_prefix(key, None, &mut slots);
                let mut fresh = Vec::new();
                if s.alloc
                    .alloc((key.len() - m.len).div_ceil(p) * p, &mut fresh)
                    .is_err()
                {
                    continue;
                }
                for (k, slot) in fresh.iter().enumerate().take(key.len() - m.len) {
                    s.ctl
                        .lock()
                        .set_device_tag(*slot, tag(&key[..m.len + k + 1]));
                }
                slots.extend_from_slice(&fresh[..key.len() - m.len]);
                let r = s
                    .cache
                    .insert(key, None, &slots, InsertOptions::default())
                    .unwrap();
                assert_eq!(r.prefix_len, m.len);
                let owned = r.prefix_len + r.inserted;
                s.alloc.free(&fresh[owned - m.len..]).unwrap();
                if failing {
                    s.ctl.lock().writes_fail = false;
                    s.acks();
                }
            }
            TierOp::MatchLoad(b, l, quota) | TierOp::MatchLoadFailing(b, l, quota) => {
                let failing = matches!(op, TierOp::MatchLoadFailing(..));
                s.ctl.lock().loads_fail = failing;
                let key = &bases[b][..l];
                let mut out = Vec::new();
                let m = s.cache.match_prefix(key, None, &mut out);
                assert_eq!(out.len(), m.len);
                let lb = s
                    .cache
                    .init_load_back(m.last_host_node, &mut out, &mut s.alloc, quota * p)
                    .unwrap();
                assert!(lb.loaded == 0 || lb.loaded == m.host_hit_len);
                // The quota gets back what locking the matched path took from the evictable.
                assert!(lb.loaded <= quota * p + m.len);
                if failing {
                    // The failed ack queues the copy again; with the device back, it lands
                    // (a pass would wait for it), so the rows check below holds.
                    s.ctl.lock().loads_fail = false;
                    s.acks();
                }
                let ctl = s.ctl.lock();
                for (k, slot) in out.iter().enumerate() {
                    assert_eq!(
                        ctl.device[slot.index()],
                        tag(&key[..k + 1]),
                        "step {step} {op:?}: row {k} of {key:?} at {slot}"
                    );
                }
            }
            TierOp::Evict(n) => {
                let before = s.cache.evictable_size();
                let freed = s.cache.evict(n, &mut s.alloc).unwrap();
                assert!(
                    freed >= n.min(before) || freed == before,
                    "{freed} {before} {n}"
                );
            }
            TierOp::EvictHost(n) => {
                s.cache.evict_host(n).unwrap();
            }
            TierOp::Lock(b, l) => {
                let mut out = Vec::new();
                let m = s.cache.match_prefix(&bases[b][..l], None, &mut out);
                s.cache.inc_lock_ref(m.last_host_node).unwrap();
                locks.push(m.last_host_node);
            }
            TierOp::Unlock(i) => {
                if !locks.is_empty() {
                    let n = locks.remove(i % locks.len());
                    s.cache.dec_lock_ref(n).unwrap();
                }
            }
            TierOp::Acks => s.acks(),
            TierOp::WriteBackPath(b, l) => {
                let mut out = Vec::new();
                let m = s.cache.match_prefix(&bases[b][..l], None, &mut out);
                s.cache.write_back_path(m.last_node).unwrap();
            }
            TierOp::Prefetch(b, l) => {
                let rid = (b % 4) as u64;
                s.cache
                    .prefetch_from_storage(rid, &bases[b][..l], None)
                    .unwrap();
            }
            TierOp::Progress(rid, t) => {
                s.cache.check_prefetch_progress(rid, t as f64).unwrap();
            }
            TierOp::Release(rid) => s.cache.release_prefetch(rid).unwrap(),
            TierOp::Flush => {
                s.cache.evict(usize::MAX / 2, &mut s.alloc).unwrap();
                s.cache.evict_host(usize::MAX / 2).unwrap();
            }
        }
        s.check(&format!("step {step} {op:?}"));
        if std::env::var("TIER_DEBUG").is_ok() {
            eprintln!("{step} {op:?}\n{}", s.cache.render_with(&|t| t.to_string()));
        }
    }
    for n in locks {
        s.cache.dec_lock_ref(n).unwrap();
    }
    for rid in 0..4 {
        s.cache.release_prefetch(rid).unwrap();
    }
    s.acks();
    s.acks();
    s.check("end");
    let stats = s.cache.tier_stats().unwrap();
    assert_eq!(s.cache.protected_size(), 0);
    s.cache.reset(&mut s.alloc).unwrap();
    assert_eq!(s.alloc.available_size(), s.alloc.size());
    let st = s.cache.tier_stats().unwrap();
    assert_eq!(st.host_slots_used, 0, "reset frees the host pool");
    stats
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config {
        cases: 256,
        failure_persistence: None,
        // Reproducible: the same cases on every machine.
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x7e5f),
        ..proptest::test_runner::Config::default()
    })]
    #[test]
    fn random_tier_ops_keep_both_partitions_and_rows(
        page in proptest::sample::select(vec![1u32, 2, 4]),
        write in proptest::sample::select(WritePolicy::ALL.to_vec()),
        prefetch in proptest::sample::select(PrefetchPolicy::ALL.to_vec()),
        ops in proptest::collection::vec(tier_op(), 1..80),
    ) {
        run_tier_ops(page, write, prefetch, &ops);
    }
}

#[test]
fn flushed_pages_come_back_from_storage() {
    use TierOp::*;
    for page in [1, 2, 4] {
        for write in WritePolicy::ALL {
            let ops = [
                Insert(0, 24),
                Insert(0, 24),
                Acks,
                Acks,
                Flush,
                Prefetch(0, 24),
                Acks,
                Acks,
                Progress(0, 0),
                MatchLoad(0, 24, 30),
            ];
            let st = run_tier_ops(page, write, PrefetchPolicy::WaitComplete, &ops);
            // Write-back copies only on eviction, so nothing reached storage before the flush
            // (and the flush could not host-evict the copy still pinned by its write).
            let expected = if write == WritePolicy::WriteBack {
                0
            } else {
                24
            };
            assert_eq!(st.storage_hit_tokens, expected, "P={page} {write}");
            assert_eq!(st.host_hit_tokens, 24, "P={page} {write}: loaded back");
        }
    }
}

#[test]
fn a_node_split_before_its_write_ack_is_backed_up_whole_and_namespaces_seed_their_keys() {
    use radix_cache::events::{chain_digests, digest_to_block_id, namespace_seed};
    use radix_cache::KvEvent;
    let ctl = ImmediateController::with_tags(34, 34, 2).with_storage();
    let mut s = Story::new(2, 32, cfg(WritePolicy::WriteThrough, 32), ctl);
    let key = toks("ABCDEF");
    let mut slots = Vec::new();
    s.alloc.alloc(6, &mut slots).unwrap();
    s.cache
        .insert(&key, Some("lora"), &slots, InsertOptions::default())
        .unwrap();
    // Split the node before the write's ack.
    let mut out = Vec::new();
    let m = s.cache.match_prefix(&toks("ABCD"), Some("lora"), &mut out);
    assert_eq!(m.len, 4);
    s.acks();
    s.check("write ack after a split");
    let seed = namespace_seed(Some("lora"));
    let digests = chain_digests(seed.as_ref(), &key, 2);
    let mut backed = backup_keys(&s.ctl);
    backed.sort();
    let mut expected = digests.clone();
    expected.sort();
    assert_eq!(
        backed, expected,
        "both halves backed up, keys chained from the seed"
    );
    // Events chain from the same seed; the first page has no parent block.
    let events = s.cache.take_events();
    assert_eq!(
        events[0],
        KvEvent::BlockStored {
            block_hashes: digests.iter().map(digest_to_block_id).collect(),
            parent_block_hash: None,
            token_ids: key.clone(),
            block_size: 2,
        }
    );
    s.acks();
    s.check("backup acks");
}

#[test]
fn write_back_path_takes_the_ack_of_the_write_through_its_insert_queued() {
    // Retraction to host under write-through: the retracted request's insert backs its path
    // up, locked until the write's ack; write_back_path waits for that copy and takes its ack,
    // so the retracted KV can be evicted (demoted) at once, as retraction needs.
    let ctl = ImmediateController::with_tags(34, 34, 2);
    let mut s = Story::new(2, 32, cfg(WritePolicy::WriteThrough, 32), ctl);
    s.insert("ABCD");
    assert_eq!(s.cache.protected_size(), 4, "locked until the write's ack");
    let mut out = Vec::new();
    let m = s.cache.match_prefix(&toks("ABCD"), None, &mut out);
    assert_eq!(
        s.cache.write_back_path(m.last_node).unwrap(),
        0,
        "already queued"
    );
    assert_eq!(s.cache.protected_size(), 0);
    s.check("write_back_path after a write-through insert");
    assert_eq!(s.cache.evict(4, &mut s.alloc).unwrap(), 4);
    s.check("evicted in the same step");
    let mut out = Vec::new();
    let m = s.cache.match_prefix(&toks("ABCD"), None, &mut out);
    assert_eq!((m.len, m.host_hit_len), (0, 4), "demoted, not deleted");
}

#[test]
fn write_back_path_makes_eviction_demote_and_a_released_prefetch_frees_at_its_ack() {
    let ctl = ImmediateController::with_tags(34, 34, 2).with_storage();
    let mut s = Story::new(2, 32, cfg(WritePolicy::WriteThroughSelective, 32), ctl);
    // Retraction to host: one insert (below the selective threshold), then write_back_path.
    s.insert("ABCD");
    let mut out = Vec::new();
    let m = s.cache.match_prefix(&toks("ABCD"), None, &mut out);
    assert_eq!(s.cache.write_back_path(m.last_node).unwrap(), 4);
    s.acks();
    s.acks();
    s.cache.evict(4, &mut s.alloc).unwrap();
    s.check("evicted after write_back_path");
    let mut out = Vec::new();
    let m = s.cache.match_prefix(&toks("ABCD"), None, &mut out);
    assert_eq!((m.len, m.host_hit_len), (0, 4), "demoted, not deleted");
    // Host-evict it: only storage has it now; prefetch it, and abort while the copy is in flight.
    assert_eq!(s.cache.evict_host(4).unwrap(), 4);
    let before = s.cache.tier_stats().unwrap().host_slots_used;
    s.cache
        .prefetch_from_storage(9, &toks("ABCDEF"), None)
        .unwrap();
    s.acks(); // the query's ack queues the copy
    assert_eq!(s.cache.tier_stats().unwrap().host_slots_used, before + 4);
    s.cache.release_prefetch(9).unwrap();
    s.check("released while the copy is in flight: its pages stay held");
    assert_eq!(s.cache.tier_stats().unwrap().host_slots_used, before + 4);
    s.acks();
    s.check("the copy's ack frees them");
    assert_eq!(s.cache.tier_stats().unwrap().host_slots_used, before);
    assert!(s.cache.check_prefetch_progress(9, 0.0).unwrap());
}

#[test]
fn storage_keys_are_the_page_chain_with_events_off_too() {
    use radix_cache::events::{chain_digests, namespace_seed};
    for events in [false, true] {
        let ctl = Shared(Arc::new(Mutex::new(
            ImmediateController::with_tags(34, 34, 2).with_storage(),
        )));
        let mut cache = RadixCache::new(2, BuiltinPolicy::Lru)
            .with_events(events)
            .with_host_tier(cfg(WritePolicy::WriteThrough, 32), Box::new(ctl.clone()))
            .unwrap();
        let slots: Vec<Slot> = (2..10).map(Slot).collect();
        let opts = InsertOptions::default();
        cache
            .insert(&toks("ABCD"), Some("ns"), &slots[..4], opts)
            .unwrap();
        cache
            .insert(&toks("ABCDEFGH"), Some("ns"), &slots, opts)
            .unwrap();
        cache.check_hicache_events().unwrap();
        let keys = backup_keys(&ctl);
        let seed = namespace_seed(Some("ns"));
        assert_eq!(
            keys,
            chain_digests(seed.as_ref(), &toks("ABCDEFGH"), 2),
            "events {events}"
        );
    }
}

#[test]
fn a_host_pin_keeps_a_retracted_path_from_host_eviction_until_unpinned() {
    let ctl = ImmediateController::with_tags(34, 34, 2);
    let mut s = Story::new(2, 32, cfg(WritePolicy::WriteThroughSelective, 32), ctl);
    s.insert("ABCD");
    let mut out = Vec::new();
    let m = s.cache.match_prefix(&toks("ABCD"), None, &mut out);
    // Without a backup there is nothing on host to pin.
    assert!(!s.cache.pin_host(m.last_node).unwrap());
    assert_eq!(s.cache.write_back_path(m.last_node).unwrap(), 4);
    assert!(s.cache.pin_host(m.last_node).unwrap());
    s.acks();
    s.cache.evict(4, &mut s.alloc).unwrap();
    s.check("demoted while pinned");
    assert_eq!(
        s.cache.evict_host(4).unwrap(),
        0,
        "a pinned path stays on host"
    );
    s.cache.unpin_host(m.last_node).unwrap();
    assert!(
        s.cache.unpin_host(m.last_node).is_err(),
        "a second unpin is refused"
    );
    assert_eq!(s.cache.evict_host(4).unwrap(), 4);
    s.check("host-evicted after the unpin");
}

/// A load-back whose copy failed leaves its device rows undefined: its ack queues the same
/// copy again and keeps the chain locked, so a pass reading the chain waits for the retry, and
/// once a retry lands the rows are the prefix's.
#[test]
fn a_failed_load_back_is_queued_again_until_it_lands() {
    let mut s = Story::new(
        1,
        32,
        cfg(WritePolicy::WriteThrough, 32),
        ImmediateController::with_tags(33, 33, 1),
    );
    let key = "ABCDEFGHIJKL";
    s.insert(key);
    s.acks();
    assert_eq!(s.cache.evict(12, &mut s.alloc).unwrap(), 12);
    s.step("ABCDEFGHIJKL demoted");

    s.ctl.lock().loads_fail = true;
    let mut out = Vec::new();
    let m = s.cache.match_prefix(&toks(key), None, &mut out);
    assert_eq!((m.len, m.host_hit_len), (0, 12));
    let lb = s
        .cache
        .init_load_back(m.last_host_node, &mut out, &mut s.alloc, 1000)
        .unwrap();
    assert_eq!(lb.loaded, 12);
    let garbage = |s: &Story, out: &[Slot]| {
        let ctl = s.ctl.lock();
        out.iter()
            .all(|d| ctl.device[d.index()] == ImmediateController::GARBAGE)
    };
    assert!(garbage(&s, &out));
    s.step("load-back queued; its copy fails");
    // The failed ack queues the copy again (it fails again: the device is still failing).
    s.acks();
    s.step("failed ack: the same copy queued again, the chain still locked");
    assert!(garbage(&s, &out));
    assert_eq!(s.cache.protected_size(), 12, "the chain stays locked");
    s.ctl.lock().loads_fail = false;
    s.acks();
    s.step("failed again: queued again; this copy lands");
    s.acks();
    s.step("ack: unlocked");
    let t = s.cache.tier_stats().unwrap();
    assert_eq!((t.loads_queued, t.loads_retried, t.loads_acked), (1, 2, 3));
    assert_eq!(t.ops_failed, 2);
    assert_eq!(s.cache.protected_size(), 0);
    let mut again = Vec::new();
    let m = s.cache.match_prefix(&toks(key), None, &mut again);
    assert_eq!(
        (m.len, again),
        (12, out.clone()),
        "a device hit on the same slots"
    );
    let ctl = s.ctl.lock();
    for (k, slot) in out.iter().enumerate() {
        assert_eq!(
            ctl.device[slot.index()],
            tag(&toks(key)[..k + 1]),
            "row {k}"
        );
    }
    drop(ctl);
    insta::assert_snapshot!(s.log);
}

/// A device that keeps failing: after four attempts of the same load-back the cache stops
/// with `CopyFailed` instead of retrying for ever.
#[test]
fn a_copy_that_keeps_failing_stops_with_an_error() {
    let mut s = Story::new(
        1,
        32,
        cfg(WritePolicy::WriteThrough, 32),
        ImmediateController::with_tags(33, 33, 1),
    );
    let key = toks("ABCDEFGHIJKL");
    s.insert("ABCDEFGHIJKL");
    s.acks();
    s.cache.evict(12, &mut s.alloc).unwrap();
    s.ctl.lock().loads_fail = true;
    let mut out = Vec::new();
    let m = s.cache.match_prefix(&key, None, &mut out);
    s.cache
        .init_load_back(m.last_host_node, &mut out, &mut s.alloc, 1000)
        .unwrap();
    for attempt in 1..4 {
        s.cache
            .check_hicache_events()
            .unwrap_or_else(|e| panic!("attempt {attempt}: {e}"));
    }
    let err = s.cache.check_hicache_events().unwrap_err().to_string();
    assert!(
        err.contains("the load copy of") && err.contains("failed 4 times") && err.contains("lost"),
        "{err}"
    );
}
