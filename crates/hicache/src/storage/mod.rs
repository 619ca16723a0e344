//! L3 storage (SGLang's `HiCacheStorage`, `mem_cache/hicache_storage.py`): a store of whole KV
//! pages keyed by [`PageKey`]s, shared across servers and restarts.
//!
//! Pages travel in kv-pool's canonical packed page format (`kv_pool::store`), `page_bytes`
//! bytes each. Keys are the chained SHA-256 page hashes radix-cache computes; a backend prefixes
//! them with its namespace (model and KV layout), so two models never share a key.

use kv_pool::PageKey;

/// Counters of one storage backend since it was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StorageStats {
    /// `batch_get` calls.
    pub gets: u64,
    /// `batch_set` calls.
    pub sets: u64,
    /// Pages found by `batch_exists` / `batch_get`.
    pub hit_pages: u64,
    /// Pages asked for and not found.
    pub miss_pages: u64,
    /// Bytes read from the store.
    pub bytes_read: u64,
    /// Bytes written to the store.
    pub bytes_written: u64,
    /// Calls that failed (the store unreachable, an IO error, a page of the wrong size).
    pub errors: u64,
}

/// Why a storage call failed.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The configuration cannot be used (unknown key, missing directory or URL, bad JSON).
    #[error("invalid HiCache storage configuration: {0}")]
    InvalidConfig(String),
    /// The store failed or could not be reached.
    #[error("HiCache storage backend {backend} failed: {reason}")]
    Backend {
        /// `file` or `redis`.
        backend: &'static str,
        /// What failed.
        reason: String,
    },
    /// A buffer whose length is not `keys.len() × page_bytes`.
    #[error("{what} holds {got} bytes, expected {expected}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// `keys.len() × page_bytes`.
        expected: usize,
        /// Its length.
        got: usize,
    },
}

/// An L3 store of KV pages (SGLang's `HiCacheStorage`). Thread-safe: the cache controller calls
/// it from its storage thread. A backend that fails or cannot be reached answers as a miss
/// (`batch_exists` / `batch_get` return 0 and count an error): HiCache degrades to recompute,
/// never to a failed request.
pub trait HiCacheStorage: Send + Sync {
    /// `file` or `redis`.
    fn name(&self) -> &'static str;
    /// Bytes of one page (what `batch_get` / `batch_set` move per key).
    fn page_bytes(&self) -> usize;
    /// How many leading `keys` the store holds (SGLang's `batch_exists`: the longest hit prefix).
    fn batch_exists(&self, keys: &[PageKey]) -> usize;
    /// Copies the leading pages the store holds into `out` (`keys.len() × page_bytes`, page `i`
    /// at `i × page_bytes`); returns how many leading pages were copied.
    fn batch_get(&self, keys: &[PageKey], out: &mut [u8]) -> Result<usize, StorageError>;
    /// Stores `data` (`keys.len() × page_bytes`, page `i` under `keys[i]`).
    fn batch_set(&self, keys: &[PageKey], data: &[u8]) -> Result<(), StorageError>;
    /// Removes every page of this backend's namespace.
    fn clear(&self) -> Result<(), StorageError>;
    /// Counters since the backend was opened.
    fn stats(&self) -> StorageStats;
}
