//! L3 storage (SGLang's `HiCacheStorage`, `mem_cache/hicache_storage.py`): a store of whole KV
//! pages keyed by [`PageKey`]s, shared across servers and restarts.
//!
//! Pages travel in kv-pool's canonical packed page format (`kv_pool::store`), `page_bytes`
//! bytes each. Keys are the chained SHA-256 page hashes radix-cache computes; a backend prefixes
//! them with its namespace (model and KV layout), so two models never share a key.
//!
//! - [`HiCacheStorage`]: the trait the cache controller calls from its storage thread.
//! - [`StorageConfig`]: `--hicache-storage-backend-extra-config` (a JSON object: SGLang's
//!   prefetch keys and the backends' own keys), unknown keys refused.
//! - [`StorageNamespace`]: the model and KV layout a backend prefixes every key with.
//! - [`open_storage`]: a backend by [`StorageKind`] (`file`, `redis`).
//! - Backends: [`HiCacheFile`] (SGLang's `HiCacheFile`: one file per page) and, with the `redis`
//!   feature, `HiCacheRedis` (one Redis server or a Redis Cluster).
//! - `testing` (feature `testing`): `check_storage`, the conformance suite every backend passes,
//!   `check_unreachable`, and `MemoryStorage`, an in-memory store that can be switched down.

mod config;
mod counters;
mod file;
mod hex;
mod namespace;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "testing")]
pub mod testing;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use kv_pool::PageKey;

#[cfg(feature = "redis")]
pub use self::redis::HiCacheRedis;
pub use config::StorageConfig;
pub use file::HiCacheFile;
pub use namespace::StorageNamespace;

/// Pages per storage IO call (SGLang's `STORAGE_BATCH_SIZE`): backends split longer batches,
/// so one call never builds an unbounded request.
pub const STORAGE_BATCH_SIZE: usize = 128;

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
    /// The configuration cannot be used (missing directory or URL, bad JSON, a value of the
    /// wrong type, a key of another backend).
    #[error("invalid HiCache storage configuration: {0}")]
    InvalidConfig(String),
    /// `--hicache-storage-backend-extra-config` names a key no part of kvserve reads.
    #[error(
        "unknown key `{key}` in --hicache-storage-backend-extra-config (known: {})",
        config::KNOWN_KEYS.join(", ")
    )]
    UnknownConfigKey {
        /// The key, as written.
        key: String,
    },
    /// The backend was not compiled in (the `redis` backend needs the `redis` feature).
    #[error("HiCache storage backend `{0}` is not compiled in (build with feature `hicache/{0}`)")]
    NotCompiled(&'static str),
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

/// Checks that a buffer of `got` bytes holds `keys` pages of `page_bytes`.
pub(crate) fn check_len(
    what: &'static str,
    keys: usize,
    page_bytes: usize,
    got: usize,
) -> Result<(), StorageError> {
    let expected = keys.saturating_mul(page_bytes);
    if got == expected {
        Ok(())
    } else {
        Err(StorageError::LengthMismatch {
            what,
            expected,
            got,
        })
    }
}

/// Which L3 backend `--hicache-storage-backend` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageKind {
    /// [`HiCacheFile`]: one file per page under a directory (SGLang's `file`).
    File,
    /// `HiCacheRedis`: one Redis server or a Redis Cluster (feature `redis`).
    Redis,
}

impl StorageKind {
    /// The name `--hicache-storage-backend` takes.
    pub const fn name(self) -> &'static str {
        match self {
            StorageKind::File => "file",
            StorageKind::Redis => "redis",
        }
    }
}

impl fmt::Display for StorageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for StorageKind {
    type Err = StorageError;

    fn from_str(s: &str) -> Result<Self, StorageError> {
        match s {
            "file" => Ok(StorageKind::File),
            "redis" => Ok(StorageKind::Redis),
            _ => Err(StorageError::InvalidConfig(format!(
                "unknown --hicache-storage-backend {s:?}; expected file or redis"
            ))),
        }
    }
}

/// Opens the `kind` backend for pages of `page_bytes` bytes under `namespace`, configured by
/// `cfg` (SGLang's `StorageBackendFactory.create_backend`). A key that belongs to the other
/// backend (a Redis URL for `file`, a directory for `redis`) is refused; `file` defaults to
/// SGLang's directory `/tmp/hicache`, `redis` needs `url` or `urls`. A Redis server that
/// cannot be reached yet is not an error: calls answer as misses until it can be.
pub fn open_storage(
    kind: StorageKind,
    cfg: &StorageConfig,
    namespace: &StorageNamespace,
    page_bytes: usize,
) -> Result<Arc<dyn HiCacheStorage>, StorageError> {
    cfg.check_backend_keys(kind)?;
    match kind {
        StorageKind::File => {
            let dir = cfg
                .file_path
                .clone()
                .unwrap_or_else(|| config::DEFAULT_FILE_PATH.into());
            Ok(Arc::new(HiCacheFile::open(&dir, namespace, page_bytes)?))
        }
        #[cfg(feature = "redis")]
        StorageKind::Redis => Ok(Arc::new(HiCacheRedis::open(cfg, namespace, page_bytes)?)),
        #[cfg(not(feature = "redis"))]
        StorageKind::Redis => Err(StorageError::NotCompiled("redis")),
    }
}
