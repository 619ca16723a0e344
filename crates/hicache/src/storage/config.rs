//! [`StorageConfig`]: `--hicache-storage-backend-extra-config`, the JSON object SGLang passes to
//! its storage backends, with SGLang's prefetch keys (read by the tree's prefetch policy) and
//! the keys of kvserve's two backends. Every key is checked: a key nothing reads is refused
//! with [`StorageError::UnknownConfigKey`] naming it, so a typo never silently falls back to a
//! default.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Map, Value};

use super::{StorageError, StorageKind};

/// SGLang's default directory of the `file` backend (`HiCacheFile(file_path="/tmp/hicache")`).
pub(crate) const DEFAULT_FILE_PATH: &str = "/tmp/hicache";

/// Every key [`StorageConfig::from_json`] accepts.
pub(crate) const KNOWN_KEYS: &[&str] = &[
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max",
    "hicache_storage_pass_prefix_keys",
    "tp_lcm_size",
    "file_path",
    "directory",
    "url",
    "redis_url",
    "urls",
    "connect_timeout_ms",
    "io_timeout_ms",
];

/// Keys of SGLang's `file` backend that kvserve's does not implement (its disk-size cap with LRU
/// eviction, and the metadata cache of lookups): refused with a message saying so, not
/// silently ignored.
const SGLANG_FILE_KEYS_NOT_IMPLEMENTED: &[&str] = &[
    "max_size",
    "min_free_space",
    "eviction_ratio",
    "enable_metadata_cache",
    "metadata_ttl",
];

/// `--hicache-storage-backend-extra-config`, parsed. `Default` is the empty object: SGLang's
/// prefetch defaults (§1.5 of the reference: 256 tokens, 2 s + 0.1 s per 1024 tokens, at most
/// 30 s), no directory (the `file` backend then uses `/tmp/hicache`), no Redis URL.
#[derive(Debug, Clone, PartialEq)]
pub struct StorageConfig {
    /// `file_path` (SGLang's name) or `directory`: the `file` backend's root directory; pages
    /// go to `<file_path>/<namespace>/`.
    pub file_path: Option<PathBuf>,
    /// `url` / `redis_url`: one Redis server (`redis://host:port[/db]`).
    pub url: Option<String>,
    /// `urls`: the seed nodes of a Redis Cluster (one or more `redis://host:port`).
    pub cluster_urls: Vec<String>,
    /// `connect_timeout_ms`: the bound on opening a Redis connection (default 1000 ms).
    pub connect_timeout: Duration,
    /// `io_timeout_ms`: the bound on one Redis read or write (default 2000 ms), so a dead
    /// server never holds the storage thread longer than that per call.
    pub io_timeout: Duration,
    /// `prefetch_threshold`: tokens an L3 prefetch must cover to start (SGLang: 256).
    pub prefetch_threshold: usize,
    /// `prefetch_timeout_base`: seconds of the `timeout` prefetch policy's fixed part (2.0).
    pub prefetch_timeout_base_s: f64,
    /// `prefetch_timeout_per_ki_token`: seconds per 1024 prefetched tokens (0.1).
    pub prefetch_timeout_per_ki_token_s: f64,
    /// `prefetch_timeout_max`: the `timeout` policy's cap in seconds (30.0).
    pub prefetch_timeout_max_s: f64,
    /// `hicache_storage_pass_prefix_keys`: accepted for SGLang compatibility; kvserve's keys
    /// are already chained over the whole prefix, so it changes nothing.
    pub pass_prefix_keys: bool,
    /// `tp_lcm_size`: accepted for SGLang compatibility (kvserve runs one TP rank).
    pub tp_lcm_size: Option<u64>,
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig {
            file_path: None,
            url: None,
            cluster_urls: Vec::new(),
            connect_timeout: Duration::from_millis(1000),
            io_timeout: Duration::from_millis(2000),
            prefetch_threshold: 256,
            prefetch_timeout_base_s: 2.0,
            prefetch_timeout_per_ki_token_s: 0.1,
            prefetch_timeout_max_s: 30.0,
            pass_prefix_keys: false,
            tp_lcm_size: None,
        }
    }
}

impl StorageConfig {
    /// Parses the flag's value as SGLang does: `@path` reads the file (`.json` only; SGLang
    /// also reads TOML and YAML there), anything else is inline JSON. Empty is the default.
    pub fn from_arg(arg: &str) -> Result<Self, StorageError> {
        let Some(path) = arg.strip_prefix('@') else {
            return Self::from_json(arg);
        };
        if !path.to_ascii_lowercase().ends_with(".json") {
            return Err(StorageError::InvalidConfig(format!(
                "--hicache-storage-backend-extra-config @{path}: only .json files are read"
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| {
            StorageError::InvalidConfig(format!(
                "--hicache-storage-backend-extra-config @{path}: {e}"
            ))
        })?;
        Self::from_json(&text)
    }

    /// Parses a JSON object (empty or blank text is the default). Unknown keys are
    /// [`StorageError::UnknownConfigKey`]; a value of the wrong type, `url` together with
    /// `urls`, or two spellings of one key are [`StorageError::InvalidConfig`] naming the key.
    pub fn from_json(text: &str) -> Result<Self, StorageError> {
        let mut cfg = StorageConfig::default();
        if text.trim().is_empty() {
            return Ok(cfg);
        }
        let value: Value = serde_json::from_str(text).map_err(|e| {
            StorageError::InvalidConfig(format!(
                "--hicache-storage-backend-extra-config is not JSON: {e}"
            ))
        })?;
        let Value::Object(map) = value else {
            return Err(StorageError::InvalidConfig(
                "--hicache-storage-backend-extra-config must be a JSON object".into(),
            ));
        };
        if let Some(key) = map.keys().find(|k| !KNOWN_KEYS.contains(&k.as_str())) {
            if SGLANG_FILE_KEYS_NOT_IMPLEMENTED.contains(&key.as_str()) {
                return Err(StorageError::InvalidConfig(format!(
                    "`{key}` configures SGLang's file backend's size cap or metadata cache, \
                     which kvserve's file backend does not implement"
                )));
            }
            return Err(StorageError::UnknownConfigKey { key: key.clone() });
        }
        if let Some(v) = map.get("prefetch_threshold") {
            cfg.prefetch_threshold = uint("prefetch_threshold", v)? as usize;
        }
        if let Some(v) = map.get("prefetch_timeout_base") {
            cfg.prefetch_timeout_base_s = seconds("prefetch_timeout_base", v)?;
        }
        if let Some(v) = map.get("prefetch_timeout_per_ki_token") {
            cfg.prefetch_timeout_per_ki_token_s = seconds("prefetch_timeout_per_ki_token", v)?;
        }
        if let Some(v) = map.get("prefetch_timeout_max") {
            cfg.prefetch_timeout_max_s = seconds("prefetch_timeout_max", v)?;
        }
        if let Some(v) = map.get("hicache_storage_pass_prefix_keys") {
            cfg.pass_prefix_keys = v.as_bool().ok_or_else(|| {
                wrong_type("hicache_storage_pass_prefix_keys", "true or false", v)
            })?;
        }
        if let Some(v) = map.get("tp_lcm_size") {
            cfg.tp_lcm_size = Some(uint("tp_lcm_size", v)?);
        }
        cfg.file_path = one_of(&map, "file_path", "directory")?
            .map(|(key, v)| string(key, v).map(PathBuf::from))
            .transpose()?;
        if cfg
            .file_path
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty())
        {
            return Err(StorageError::InvalidConfig("`file_path` is empty".into()));
        }
        cfg.url = one_of(&map, "url", "redis_url")?
            .map(|(key, v)| string(key, v))
            .transpose()?;
        if let Some(v) = map.get("urls") {
            if cfg.url.is_some() {
                return Err(StorageError::InvalidConfig(
                    "give `url` (one Redis server) or `urls` (a Redis Cluster), not both".into(),
                ));
            }
            let Value::Array(items) = v else {
                return Err(wrong_type("urls", "a list of Redis URLs", v));
            };
            if items.is_empty() {
                return Err(StorageError::InvalidConfig("`urls` is empty".into()));
            }
            cfg.cluster_urls = items
                .iter()
                .map(|item| string("urls", item))
                .collect::<Result<_, _>>()?;
        }
        if let Some(v) = map.get("connect_timeout_ms") {
            cfg.connect_timeout = millis("connect_timeout_ms", v)?;
        }
        if let Some(v) = map.get("io_timeout_ms") {
            cfg.io_timeout = millis("io_timeout_ms", v)?;
        }
        Ok(cfg)
    }

    /// Refuses the keys of the backend that `kind` is not: a Redis URL or timeout for `file`,
    /// a directory for `redis`; and a `redis` backend without `url` or `urls`.
    pub(crate) fn check_backend_keys(&self, kind: StorageKind) -> Result<(), StorageError> {
        let redis_keys = self.url.is_some()
            || !self.cluster_urls.is_empty()
            || self.connect_timeout != StorageConfig::default().connect_timeout
            || self.io_timeout != StorageConfig::default().io_timeout;
        match kind {
            StorageKind::File if redis_keys => Err(StorageError::InvalidConfig(
                "`url`, `urls` and the Redis timeouts configure the redis backend, not file".into(),
            )),
            StorageKind::Redis if self.file_path.is_some() => Err(StorageError::InvalidConfig(
                "`file_path` configures the file backend, not redis".into(),
            )),
            StorageKind::Redis if self.url.is_none() && self.cluster_urls.is_empty() => {
                Err(StorageError::InvalidConfig(
                    "the redis backend needs `url` (one server) or `urls` (a Redis Cluster) in \
                     --hicache-storage-backend-extra-config"
                        .into(),
                ))
            }
            _ => Ok(()),
        }
    }
}

fn wrong_type(key: &str, expected: &str, got: &Value) -> StorageError {
    StorageError::InvalidConfig(format!("`{key}` must be {expected}, got {got}"))
}

/// The value of `a` or of its other spelling `b`; both present is an error.
fn one_of<'m>(
    map: &'m Map<String, Value>,
    a: &'static str,
    b: &'static str,
) -> Result<Option<(&'static str, &'m Value)>, StorageError> {
    match (map.get(a), map.get(b)) {
        (Some(_), Some(_)) => Err(StorageError::InvalidConfig(format!(
            "`{a}` and `{b}` name the same setting; give one"
        ))),
        (Some(v), None) => Ok(Some((a, v))),
        (None, Some(v)) => Ok(Some((b, v))),
        (None, None) => Ok(None),
    }
}

fn string(key: &str, v: &Value) -> Result<String, StorageError> {
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| wrong_type(key, "a string", v))
}

fn uint(key: &str, v: &Value) -> Result<u64, StorageError> {
    v.as_u64()
        .ok_or_else(|| wrong_type(key, "a non-negative integer", v))
}

fn seconds(key: &str, v: &Value) -> Result<f64, StorageError> {
    v.as_f64()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .ok_or_else(|| wrong_type(key, "a non-negative number of seconds", v))
}

fn millis(key: &str, v: &Value) -> Result<Duration, StorageError> {
    match v.as_u64() {
        Some(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
        _ => Err(wrong_type(key, "a positive integer of milliseconds", v)),
    }
}
