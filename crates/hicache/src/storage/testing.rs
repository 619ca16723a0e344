//! The L3 storage conformance suite and two stores for tests (feature `testing`).
//!
//! - [`check_storage`]: what every [`HiCacheStorage`] must do — longest-prefix lookups, exact
//!   bytes back, batches longer than [`STORAGE_BATCH_SIZE`], buffer lengths checked, pages
//!   shared by every instance of one namespace and invisible to others, `clear` limited to its
//!   namespace, counters that add up, calls from several threads at once.
//! - [`check_unreachable`]: what a store that cannot reach its backend must do — answer every
//!   lookup as a miss, fail writes with [`StorageError::Backend`], count errors, never panic.
//! - [`MemoryStorage`]: an in-memory store (one map shared by the instances made from it)
//!   with a `down` switch that makes it behave as an unreachable backend, for controller
//!   tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use kv_pool::{PageKey, SplitMix64};

use super::counters::Counters;
use super::{
    check_len, HiCacheStorage, StorageError, StorageNamespace, StorageStats, STORAGE_BATCH_SIZE,
};

/// Makes a store for `(namespace, page_bytes)`. Two calls with the same arguments must open
/// the same pages (as two servers, or a server and its restart, sharing one store do).
pub type MakeStorage<'a> = dyn FnMut(&StorageNamespace, usize) -> Arc<dyn HiCacheStorage> + 'a;

/// `n` distinct pseudo-random keys from `seed`.
pub fn random_keys(seed: u64, n: usize) -> Vec<PageKey> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let mut key = [0u8; 32];
            for chunk in key.chunks_exact_mut(8) {
                chunk.copy_from_slice(&rng.next_u64().to_le_bytes());
            }
            key
        })
        .collect()
}

/// `n` pages of `page_bytes` pseudo-random bytes from `seed`.
pub fn random_pages(seed: u64, n: usize, page_bytes: usize) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    (0..n * page_bytes).map(|_| rng.next_u64() as u8).collect()
}

fn delta(after: StorageStats, before: StorageStats) -> StorageStats {
    StorageStats {
        gets: after.gets - before.gets,
        sets: after.sets - before.sets,
        hit_pages: after.hit_pages - before.hit_pages,
        miss_pages: after.miss_pages - before.miss_pages,
        bytes_read: after.bytes_read - before.bytes_read,
        bytes_written: after.bytes_written - before.bytes_written,
        errors: after.errors - before.errors,
    }
}

/// Runs the conformance suite on the stores `make` opens, in namespaces named
/// `<tag>-check-a` and `<tag>-check-b` (both cleared first, so a store shared with other
/// tests must give each a distinct `tag`). Panics, naming the rule, on the first violation.
pub fn check_storage(tag: &str, make: &mut MakeStorage<'_>) {
    let ns_a = StorageNamespace::from_prefix(&format!("{tag}-check-a")).expect("valid tag");
    let ns_b = StorageNamespace::from_prefix(&format!("{tag}-check-b")).expect("valid tag");
    let pb = 96; // not a power of two, so an off-by-a-page copy cannot line up by chance
    let a = make(&ns_a, pb);
    let b = make(&ns_b, pb);
    a.clear().expect("clear a fresh namespace");
    b.clear().expect("clear a fresh namespace");
    assert!(!a.name().is_empty(), "a backend has a name");
    assert_eq!(
        a.page_bytes(),
        pb,
        "page_bytes is the one it was opened with"
    );

    // Empty store, empty batches.
    let n = 2 * STORAGE_BATCH_SIZE + 44; // three backend batches
    let keys = random_keys(1, n);
    let pages = random_pages(2, n, pb);
    assert_eq!(a.batch_exists(&keys), 0, "an empty store holds nothing");
    let mut out = vec![0u8; n * pb];
    assert_eq!(
        a.batch_get(&keys, &mut out).unwrap(),
        0,
        "an empty store reads nothing"
    );
    assert_eq!(a.batch_exists(&[]), 0, "no keys, no hits");
    assert_eq!(a.batch_get(&[], &mut []).unwrap(), 0, "no keys, no pages");
    a.batch_set(&[], &[]).expect("an empty write succeeds");

    // Buffers of the wrong length are typed errors.
    assert!(
        matches!(
            a.batch_get(&keys[..2], &mut out[..pb]),
            Err(StorageError::LengthMismatch { .. })
        ),
        "a short batch_get buffer is LengthMismatch"
    );
    assert!(
        matches!(
            a.batch_set(&keys[..2], &pages[..3 * pb]),
            Err(StorageError::LengthMismatch { .. })
        ),
        "a long batch_set buffer is LengthMismatch"
    );
    assert_eq!(a.batch_exists(&keys), 0, "a refused write stores nothing");

    // Write across batch boundaries; read back byte for byte; counters add up.
    let before = a.stats();
    a.batch_set(&keys, &pages).expect("batch_set");
    assert_eq!(a.batch_exists(&keys), n, "every written page exists");
    out.fill(0);
    assert_eq!(
        a.batch_get(&keys, &mut out).unwrap(),
        n,
        "every written page reads"
    );
    assert!(out == pages, "pages read back byte for byte");
    let d = delta(a.stats(), before);
    assert_eq!(d.sets, 1, "one batch_set call counted");
    assert_eq!(d.gets, 1, "one batch_get call counted");
    assert_eq!(d.bytes_written, (n * pb) as u64, "bytes written counted");
    assert_eq!(d.bytes_read, (n * pb) as u64, "bytes read counted");
    assert_eq!(d.hit_pages, 2 * n as u64, "hits of exists and get counted");
    assert_eq!(d.miss_pages, 0, "no misses");
    assert_eq!(d.errors, 0, "a healthy store counts no errors");

    // The longest hit prefix, also when the hole is in a later batch.
    let missing = random_keys(3, 1)[0];
    for hole in [0, 7, STORAGE_BATCH_SIZE, STORAGE_BATCH_SIZE + 5] {
        let mut probe = keys[..hole].to_vec();
        probe.push(missing);
        probe.extend_from_slice(&keys[hole..hole + 3]);
        let before = a.stats();
        assert_eq!(
            a.batch_exists(&probe),
            hole,
            "exists stops at the first missing page"
        );
        let mut got = vec![0xAAu8; probe.len() * pb];
        assert_eq!(
            a.batch_get(&probe, &mut got).unwrap(),
            hole,
            "get stops at the first miss"
        );
        assert!(
            got[..hole * pb] == pages[..hole * pb],
            "the leading pages are right"
        );
        let d = delta(a.stats(), before);
        assert_eq!(d.hit_pages, 2 * hole as u64, "hits of a partial lookup");
        assert_eq!(
            d.miss_pages,
            2 * (probe.len() - hole) as u64,
            "misses of a partial lookup"
        );
    }

    // Rewriting a page is harmless (pages are content-addressed).
    a.batch_set(&keys[..3], &pages[..3 * pb]).expect("rewrite");
    assert_eq!(a.batch_exists(&keys), n, "a rewrite keeps every page");

    // Another instance of the namespace sees the pages; another namespace does not.
    let a2 = make(&ns_a, pb);
    assert_eq!(
        a2.batch_exists(&keys),
        n,
        "a second instance of a namespace shares its pages"
    );
    assert_eq!(
        b.batch_exists(&keys),
        0,
        "another namespace never sees the pages"
    );
    b.batch_set(&keys[..5], &pages[5 * pb..10 * pb])
        .expect("write b");
    let mut got = vec![0u8; 5 * pb];
    assert_eq!(b.batch_get(&keys[..5], &mut got).unwrap(), 5);
    assert!(
        got == pages[5 * pb..10 * pb],
        "a namespace reads its own bytes under a shared key"
    );
    assert_eq!(a.batch_get(&keys[..5], &mut got).unwrap(), 5);
    assert!(
        got == pages[..5 * pb],
        "and the other namespace keeps its own"
    );

    // Several threads at once (the controller's storage thread and a second server).
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let store = Arc::clone(&a);
            std::thread::spawn(move || {
                let keys = random_keys(100 + t, 40);
                let pages = random_pages(200 + t, 40, pb);
                store
                    .batch_set(&keys, &pages)
                    .expect("concurrent batch_set");
                let mut got = vec![0u8; 40 * pb];
                assert_eq!(store.batch_get(&keys, &mut got).unwrap(), 40);
                assert!(got == pages, "concurrent pages read back");
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a concurrent caller panicked");
    }

    // clear empties its namespace only.
    a.clear().expect("clear");
    assert_eq!(
        a.batch_exists(&keys),
        0,
        "clear removes the namespace's pages"
    );
    assert_eq!(
        a.batch_exists(&random_keys(100, 40)),
        0,
        "clear removes every page"
    );
    assert_eq!(
        b.batch_exists(&keys[..5]),
        5,
        "clear leaves other namespaces alone"
    );
    b.clear().expect("clear b");
    assert_eq!(a.stats().errors, 0, "a healthy store counts no errors");
}

/// Checks a store whose backend cannot be reached (a stopped server, a missing directory):
/// every lookup is a miss, a write is [`StorageError::Backend`], errors are counted, and no
/// call panics. Buffer-length errors stay [`StorageError::LengthMismatch`].
pub fn check_unreachable(store: &dyn HiCacheStorage) {
    let pb = store.page_bytes();
    let keys = random_keys(7, 3);
    let pages = random_pages(8, 3, pb);
    let before = store.stats();
    assert!(
        store.batch_set(&keys, &pages).is_err(),
        "a write to an unreachable store fails"
    );
    assert_eq!(
        store.batch_exists(&keys),
        0,
        "an unreachable store is a miss"
    );
    let mut out = vec![0u8; 3 * pb];
    assert_eq!(
        store.batch_get(&keys, &mut out).unwrap_or(0),
        0,
        "an unreachable get is a miss"
    );
    assert!(
        matches!(
            store.batch_get(&keys, &mut out[..pb]),
            Err(StorageError::LengthMismatch { .. })
        ),
        "buffer lengths are still checked"
    );
    let _ = store.clear();
    let d = delta(store.stats(), before);
    assert!(d.errors >= 1, "failures are counted");
    assert_eq!(d.hit_pages, 0, "no hits");
}

/// The pages of every [`MemoryStorage`] sharing one map, by namespace and key.
type PageMap = HashMap<(String, PageKey), Vec<u8>>;

/// An in-memory store: instances made by [`with_namespace`](Self::with_namespace) share one
/// map of `(namespace, key) → page`. While [`set_down`](Self::set_down)`(true)` is in effect
/// every instance behaves as an unreachable backend (misses, failed writes, errors counted).
pub struct MemoryStorage {
    pages: Arc<Mutex<PageMap>>,
    down: Arc<AtomicBool>,
    namespace: String,
    page_bytes: usize,
    counters: Counters,
}

impl MemoryStorage {
    /// An empty store for pages of `page_bytes` in the namespace `memory`.
    pub fn new(page_bytes: usize) -> Self {
        MemoryStorage {
            pages: Arc::default(),
            down: Arc::default(),
            namespace: "memory".into(),
            page_bytes,
            counters: Counters::default(),
        }
    }

    /// Another instance over the same map, in `namespace`, for pages of `page_bytes`.
    pub fn with_namespace(&self, namespace: &StorageNamespace, page_bytes: usize) -> Self {
        MemoryStorage {
            pages: Arc::clone(&self.pages),
            down: Arc::clone(&self.down),
            namespace: namespace.prefix().to_string(),
            page_bytes,
            counters: Counters::default(),
        }
    }

    /// Makes every instance sharing this map unreachable (`true`) or reachable again.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Relaxed);
    }

    fn map(&self) -> std::sync::MutexGuard<'_, PageMap> {
        self.pages.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn is_down(&self) -> bool {
        let down = self.down.load(Relaxed);
        if down {
            self.counters.failure("memory", "switched down");
        } else {
            self.counters.success("memory");
        }
        down
    }

    fn leading_hits(&self, keys: &[PageKey]) -> usize {
        let map = self.map();
        keys.iter()
            .take_while(|k| map.contains_key(&(self.namespace.clone(), **k)))
            .count()
    }
}

impl HiCacheStorage for MemoryStorage {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    fn batch_exists(&self, keys: &[PageKey]) -> usize {
        let found = if self.is_down() {
            0
        } else {
            self.leading_hits(keys)
        };
        self.counters.lookup(keys.len(), found);
        found
    }

    fn batch_get(&self, keys: &[PageKey], out: &mut [u8]) -> Result<usize, StorageError> {
        check_len("batch_get output", keys.len(), self.page_bytes, out.len())?;
        let mut found = 0;
        if !self.is_down() {
            let map = self.map();
            for (key, page) in keys.iter().zip(out.chunks_exact_mut(self.page_bytes)) {
                match map.get(&(self.namespace.clone(), *key)) {
                    Some(bytes) => page.copy_from_slice(bytes),
                    None => break,
                }
                found += 1;
            }
        }
        self.counters.lookup(keys.len(), found);
        self.counters.get(found * self.page_bytes);
        Ok(found)
    }

    fn batch_set(&self, keys: &[PageKey], data: &[u8]) -> Result<(), StorageError> {
        check_len("batch_set input", keys.len(), self.page_bytes, data.len())?;
        if self.is_down() {
            self.counters.set(0);
            return Err(StorageError::Backend {
                backend: "memory",
                reason: "switched down".into(),
            });
        }
        let mut map = self.map();
        for (key, page) in keys.iter().zip(data.chunks_exact(self.page_bytes)) {
            map.insert((self.namespace.clone(), *key), page.to_vec());
        }
        self.counters.set(data.len());
        Ok(())
    }

    fn clear(&self) -> Result<(), StorageError> {
        if self.is_down() {
            return Err(StorageError::Backend {
                backend: "memory",
                reason: "switched down".into(),
            });
        }
        self.map().retain(|(ns, _), _| *ns != self.namespace);
        Ok(())
    }

    fn stats(&self) -> StorageStats {
        self.counters.snapshot()
    }
}
