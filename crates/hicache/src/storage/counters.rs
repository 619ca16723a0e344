//! A backend's bookkeeping: [`StorageStats`] counters shared by every thread that calls it, and
//! the failure streak that is logged once when it starts and once when it ends.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use super::StorageStats;

/// Atomic [`StorageStats`] plus the failure-streak flag.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    gets: AtomicU64,
    sets: AtomicU64,
    hit_pages: AtomicU64,
    miss_pages: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    errors: AtomicU64,
    failing: AtomicBool,
}

impl Counters {
    /// A lookup (`batch_exists`, or the page count of a `batch_get`) of `asked` keys that found
    /// the first `found`.
    pub(crate) fn lookup(&self, asked: usize, found: usize) {
        self.hit_pages.fetch_add(found as u64, Relaxed);
        self.miss_pages
            .fetch_add(asked.saturating_sub(found) as u64, Relaxed);
    }

    /// A `batch_get` call that read `bytes`.
    pub(crate) fn get(&self, bytes: usize) {
        self.gets.fetch_add(1, Relaxed);
        self.bytes_read.fetch_add(bytes as u64, Relaxed);
    }

    /// A `batch_set` call (`bytes` written when it succeeded, 0 otherwise).
    pub(crate) fn set(&self, bytes: usize) {
        self.sets.fetch_add(1, Relaxed);
        self.bytes_written.fetch_add(bytes as u64, Relaxed);
    }

    /// A failed call: counted, and logged when it starts a failure streak.
    pub(crate) fn failure(&self, backend: &str, what: &str) {
        self.errors.fetch_add(1, Relaxed);
        if !self.failing.swap(true, Relaxed) {
            eprintln!(
                "kvserve hicache: {backend} storage failed ({what}); its pages count as misses \
                 until it answers again"
            );
        }
    }

    /// A call that reached the store: ends a failure streak (logged).
    pub(crate) fn success(&self, backend: &str) {
        if self.failing.load(Relaxed) && self.failing.swap(false, Relaxed) {
            eprintln!("kvserve hicache: {backend} storage answers again");
        }
    }

    /// The counters now.
    pub(crate) fn snapshot(&self) -> StorageStats {
        StorageStats {
            gets: self.gets.load(Relaxed),
            sets: self.sets.load(Relaxed),
            hit_pages: self.hit_pages.load(Relaxed),
            miss_pages: self.miss_pages.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
            errors: self.errors.load(Relaxed),
        }
    }
}
