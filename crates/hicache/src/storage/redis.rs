//! `HiCacheRedis` (feature `redis`): L3 pages in Redis, one server or a Redis Cluster (see the
//! type's docs).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kv_pool::PageKey;
use redis::cluster::{cluster_pipe, ClusterClient, ClusterConnection};
use redis::{Client, Connection, ConnectionLike, RedisResult};

use super::counters::Counters;
use super::hex::key_hex;
use super::{
    check_len, HiCacheStorage, StorageConfig, StorageError, StorageNamespace, StorageStats,
    STORAGE_BATCH_SIZE,
};

/// The first wait after a failed connect; doubled per failure up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// The longest wait between two connection attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// The most page bytes one `MGET` / `MSET` moves (unless one page is larger): large pages
/// (64 tokens of a big model are megabytes) would otherwise make one command of up to
/// 128 pages approach Redis's 1 GiB query-buffer limit and outlast any `io_timeout`.
const MAX_CALL_BYTES: usize = 64 << 20;
/// `STRLEN` of every key in one reply (one server): 0 for a missing key.
const STRLEN_SCRIPT: &str =
    "local r = {} for i, k in ipairs(KEYS) do r[i] = redis.call('STRLEN', k) end return r";

/// The `redis` L3 backend (feature `redis`): one value per page under
/// `kvserve:<namespace>:<hex key>`, on one server (`url`) or a Redis Cluster (`urls`, the
/// seed nodes; keys spread over the cluster's slots).
///
/// Each call is one round trip per batch of at most [`STORAGE_BATCH_SIZE`] pages (and, for
/// `MGET` / `MSET`, at most 64 MiB of pages, at least one page): `STRLEN` of
/// every key (existence with the size checked) for `batch_exists`, `MGET` for `batch_get`,
/// `MSET` for `batch_set`. On one server each is a single command with a single reply (the
/// `STRLEN`s run in a tiny Lua script); in a cluster redis-rs splits `MGET` / `MSET` by slot
/// and the `STRLEN`s are a cluster pipeline routed key by key.
///
/// A dead, frozen or unreachable Redis is a miss within a bounded time. Socket timeouts alone
/// do not bound a call: redis-rs reads every reply of a pipeline (or of the per-slot parts of
/// a cluster `MGET`) with its own timeout, so a frozen server would cost one `io_timeout` per
/// page. So each round trip runs on a short-lived helper thread that owns the connection for
/// its duration, and the caller waits for it at most `io_timeout` (plus `connect_timeout`
/// when it connects first). A call that fails or misses its deadline drops the connection
/// (after a timeout its replies could arrive late and be taken for the next call's), and the
/// helper, left behind, ends on its socket timeouts (one `io_timeout` on one server, where
/// every command has one reply). The next call reconnects at once; after a failed connect or a
/// missed deadline, the calls during a backoff (50 ms doubling to 2 s), and while a helper
/// left behind is still waiting, answer as misses without touching the network: a dead
/// server costs one bounded wait per backoff period, and at most one helper waits at a time.
pub struct HiCacheRedis {
    target: Target,
    /// `kvserve:<namespace>:`.
    key_prefix: String,
    page_bytes: usize,
    connect_timeout: Duration,
    io_timeout: Duration,
    link: Mutex<Link>,
    counters: Counters,
}

impl std::fmt::Debug for HiCacheRedis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HiCacheRedis")
            .field("key_prefix", &self.key_prefix)
            .field("page_bytes", &self.page_bytes)
            .field("cluster", &matches!(self.target, Target::Cluster(_)))
            .finish_non_exhaustive()
    }
}

#[derive(Clone)]
enum Target {
    Single(Client),
    Cluster(ClusterClient),
}

enum Conn {
    Single(Connection),
    /// Boxed: a cluster connection is four times the size of a single one.
    Cluster(Box<ClusterConnection>),
}

impl Conn {
    fn as_dyn(&mut self) -> &mut dyn ConnectionLike {
        match self {
            Conn::Single(c) => c,
            Conn::Cluster(c) => c.as_mut(),
        }
    }
}

/// The connection and the reconnect schedule.
struct Link {
    conn: Option<Conn>,
    /// No connection attempt before this instant (set after a failed connect).
    retry_at: Option<Instant>,
    /// The wait after the next failed connect.
    backoff: Duration,
    /// Set while a helper thread runs (the one the caller waits for, or one left behind).
    helper_busy: Arc<AtomicBool>,
}

impl HiCacheRedis {
    /// Opens the backend configured by `cfg`'s `url` (one server) or `urls` (a Redis Cluster)
    /// for pages of `page_bytes` bytes under `namespace`. A malformed URL is
    /// [`StorageError::InvalidConfig`]; a server that does not answer is not an error (it is
    /// tried now and again by later calls, which answer as misses meanwhile).
    pub fn open(
        cfg: &StorageConfig,
        namespace: &StorageNamespace,
        page_bytes: usize,
    ) -> Result<Self, StorageError> {
        if page_bytes == 0 {
            return Err(StorageError::InvalidConfig(
                "page_bytes must be at least 1".into(),
            ));
        }
        let bad_url = |url: &str, e: redis::RedisError| {
            StorageError::InvalidConfig(format!("Redis URL {url:?}: {e}"))
        };
        let target = match (&cfg.url, cfg.cluster_urls.as_slice()) {
            (Some(url), []) => {
                Target::Single(Client::open(url.as_str()).map_err(|e| bad_url(url, e))?)
            }
            (None, urls) if !urls.is_empty() => Target::Cluster(
                ClusterClient::builder(urls.iter().map(String::as_str))
                    .connection_timeout(cfg.connect_timeout)
                    .response_timeout(cfg.io_timeout)
                    // Bounded: a MOVED / ASK redirect or one retry, never redis-rs's default
                    // of 16 retries with waits of up to minutes.
                    .retries(2)
                    .min_retry_wait(10)
                    .max_retry_wait(100)
                    .build()
                    .map_err(|e| bad_url(&urls.join(", "), e))?,
            ),
            _ => {
                return Err(StorageError::InvalidConfig(
                    "the redis backend needs `url` (one server) or `urls` (a Redis Cluster)".into(),
                ))
            }
        };
        let storage = HiCacheRedis {
            target,
            key_prefix: format!("kvserve:{}:", namespace.prefix()),
            page_bytes,
            connect_timeout: cfg.connect_timeout,
            io_timeout: cfg.io_timeout,
            link: Mutex::new(Link {
                conn: None,
                retry_at: None,
                backoff: BACKOFF_MIN,
                helper_busy: Arc::default(),
            }),
            counters: Counters::default(),
        };
        // Connect now so the first lookup does not pay for it; failing is fine (see above).
        let _ = storage.with_conn("connect", |_| Ok(()));
        Ok(storage)
    }

    /// Whether the cluster path is used (`urls`).
    pub fn is_cluster(&self) -> bool {
        matches!(self.target, Target::Cluster(_))
    }

    /// Pages per `MGET` / `MSET`: [`STORAGE_BATCH_SIZE`], fewer for pages so large that
    /// would exceed [`MAX_CALL_BYTES`], at least one.
    fn pages_per_call(&self) -> usize {
        (MAX_CALL_BYTES / self.page_bytes).clamp(1, STORAGE_BATCH_SIZE)
    }

    fn key(&self, key: &PageKey) -> String {
        format!("{}{}", self.key_prefix, key_hex(key))
    }

    fn lock(&self) -> MutexGuard<'_, Link> {
        // A panic inside redis-rs while the lock was held leaves at worst a half-used
        // connection, which the next failure drops: the state is still consistent.
        self.link.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the connection (connecting first if needed, unless a backoff is running)
    /// on a helper thread, waiting for it at most the call's deadline (see the module docs).
    /// `None` when the store could not be reached, `f` failed or the deadline passed: the
    /// failure is counted and the connection dropped.
    fn with_conn<T: Send + 'static>(
        &self,
        what: &str,
        f: impl FnOnce(&mut Conn) -> RedisResult<T> + Send + 'static,
    ) -> Option<T> {
        let mut link = self.lock();
        let now = Instant::now();
        let conn = link.conn.take();
        if conn.is_none() && link.retry_at.is_some_and(|at| now < at) {
            self.counters
                .failure("redis", "not connected (waiting to reconnect)");
            return None;
        }
        // Only a helper left behind by a missed deadline can still run here (a helper the
        // caller waited for has ended before handing the connection back).
        if link.helper_busy.swap(true, Ordering::AcqRel) {
            self.counters
                .failure("redis", "not connected (the last call is still waiting)");
            return None;
        }
        let busy = BusyGuard(Arc::clone(&link.helper_busy));
        let deadline = match conn {
            Some(_) => self.io_timeout,
            None => self.io_timeout + self.connect_timeout,
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let target = self.target.clone();
        let (connect_timeout, io_timeout) = (self.connect_timeout, self.io_timeout);
        let spawned = std::thread::Builder::new()
            .name("kvserve-redis".into())
            .spawn(move || {
                let result = match conn {
                    Some(conn) => Ok(conn),
                    None => connect(&target, connect_timeout, io_timeout).map_err(Failure::Connect),
                }
                .and_then(|mut conn| match f(&mut conn) {
                    Ok(v) => Ok((v, conn)),
                    Err(e) => Err(Failure::Call(e)),
                });
                // Not busy before the caller hears back, so its next call may start a helper.
                drop(busy);
                // The caller may have stopped waiting: then nobody receives, which is fine.
                let _ = tx.send(result);
            });
        if let Err(e) = spawned {
            // The closure (and with it the busy guard) was dropped: nothing runs.
            self.counters
                .failure("redis", &format!("{what}: no helper thread: {e}"));
            return None;
        }
        let reason = match rx.recv_timeout(deadline) {
            Ok(Ok((v, conn))) => {
                link.conn = Some(conn);
                link.retry_at = None;
                link.backoff = BACKOFF_MIN;
                self.counters.success("redis");
                return Some(v);
            }
            Ok(Err(Failure::Call(e))) => format!("{what}: {e}"),
            Ok(Err(Failure::Connect(e))) => {
                link.back_off();
                format!("connect: {e}")
            }
            Err(_) => {
                link.back_off();
                format!("{what}: no answer within {deadline:?}")
            }
        };
        self.counters.failure("redis", &reason);
        None
    }
}

/// Why a helper thread's round trip failed.
enum Failure {
    Connect(redis::RedisError),
    Call(redis::RedisError),
}

/// Clears the busy flag when a helper thread ends (or is never started).
struct BusyGuard(Arc<AtomicBool>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Link {
    /// Schedules the next connection attempt after the current backoff from now, and doubles
    /// the backoff.
    fn back_off(&mut self) {
        self.retry_at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
    }
}

/// Opens a connection whose every read and write times out after `io_timeout`.
fn connect(target: &Target, connect_timeout: Duration, io_timeout: Duration) -> RedisResult<Conn> {
    match target {
        Target::Single(client) => {
            let conn = client.get_connection_with_timeout(connect_timeout)?;
            conn.set_read_timeout(Some(io_timeout))?;
            conn.set_write_timeout(Some(io_timeout))?;
            Ok(Conn::Single(conn))
        }
        Target::Cluster(client) => {
            let conn = client.get_connection()?;
            conn.set_write_timeout(Some(io_timeout))?;
            Ok(Conn::Cluster(Box::new(conn)))
        }
    }
}

/// `STRLEN` of every key (0 for a missing key): one script on one server, a pipeline routed
/// key by key in a cluster.
fn strlens(conn: &mut Conn, keys: &[String]) -> RedisResult<Vec<usize>> {
    match conn {
        Conn::Single(c) => redis::cmd("EVAL")
            .arg(STRLEN_SCRIPT)
            .arg(keys.len())
            .arg(keys)
            .query(c),
        Conn::Cluster(c) => {
            let mut pipe = cluster_pipe();
            for key in keys {
                pipe.cmd("STRLEN").arg(key);
            }
            pipe.query(c)
        }
    }
}

impl HiCacheStorage for HiCacheRedis {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    fn batch_exists(&self, keys: &[PageKey]) -> usize {
        let mut found = 0;
        for chunk in keys.chunks(STORAGE_BATCH_SIZE) {
            let names: Vec<String> = chunk.iter().map(|k| self.key(k)).collect();
            let Some(lens) = self.with_conn("STRLEN", move |c| strlens(c, &names)) else {
                break;
            };
            let hit = lens
                .iter()
                .take_while(|&&len| len == self.page_bytes)
                .count();
            if lens.get(hit).is_some_and(|&len| len != 0) {
                self.counters.failure(
                    "redis",
                    &format!(
                        "a page of {} bytes, expected {}",
                        lens[hit], self.page_bytes
                    ),
                );
            }
            found += hit;
            if hit < chunk.len() {
                break;
            }
        }
        self.counters.lookup(keys.len(), found);
        found
    }

    fn batch_get(&self, keys: &[PageKey], out: &mut [u8]) -> Result<usize, StorageError> {
        check_len("batch_get output", keys.len(), self.page_bytes, out.len())?;
        let mut found = 0;
        let per_call = self.pages_per_call();
        for (chunk, dst) in keys
            .chunks(per_call)
            .zip(out.chunks_mut(per_call * self.page_bytes))
        {
            let names: Vec<String> = chunk.iter().map(|k| self.key(k)).collect();
            let Some(values) = self.with_conn("MGET", move |c| {
                redis::cmd("MGET")
                    .arg(&names)
                    .query::<Vec<Option<Vec<u8>>>>(c.as_dyn())
            }) else {
                break;
            };
            let mut hit = 0;
            for (value, page) in values.iter().zip(dst.chunks_exact_mut(self.page_bytes)) {
                match value {
                    Some(bytes) if bytes.len() == self.page_bytes => {
                        page.copy_from_slice(bytes);
                        hit += 1;
                    }
                    Some(bytes) => {
                        self.counters.failure(
                            "redis",
                            &format!(
                                "a page of {} bytes, expected {}",
                                bytes.len(),
                                self.page_bytes
                            ),
                        );
                        break;
                    }
                    None => break,
                }
            }
            found += hit;
            if hit < chunk.len() {
                break;
            }
        }
        self.counters.lookup(keys.len(), found);
        self.counters.get(found * self.page_bytes);
        Ok(found)
    }

    fn batch_set(&self, keys: &[PageKey], data: &[u8]) -> Result<(), StorageError> {
        check_len("batch_set input", keys.len(), self.page_bytes, data.len())?;
        let per_call = self.pages_per_call();
        for (chunk, src) in keys
            .chunks(per_call)
            .zip(data.chunks(per_call * self.page_bytes))
        {
            let mut cmd = redis::cmd("MSET");
            for (key, page) in chunk.iter().zip(src.chunks_exact(self.page_bytes)) {
                cmd.arg(self.key(key)).arg(page);
            }
            if self
                .with_conn("MSET", move |c| cmd.query::<()>(c.as_dyn()))
                .is_none()
            {
                self.counters.set(0);
                return Err(StorageError::Backend {
                    backend: "redis",
                    reason: "MSET failed or the server is unreachable".into(),
                });
            }
        }
        self.counters.set(data.len());
        Ok(())
    }

    fn clear(&self) -> Result<(), StorageError> {
        // KEYS goes to every primary of a cluster (redis-rs combines the answers); clearing
        // is an administrative call, made when the server is idle.
        let pattern = format!("{}*", self.key_prefix);
        let keys = self
            .with_conn("KEYS", move |c| {
                redis::cmd("KEYS")
                    .arg(&pattern)
                    .query::<Vec<String>>(c.as_dyn())
            })
            .ok_or_else(|| StorageError::Backend {
                backend: "redis",
                reason: "listing the namespace's keys failed or the server is unreachable".into(),
            })?;
        for chunk in keys.chunks(STORAGE_BATCH_SIZE) {
            let chunk = chunk.to_vec();
            self.with_conn("UNLINK", move |c| {
                redis::cmd("UNLINK").arg(chunk).query::<i64>(c.as_dyn())
            })
            .ok_or_else(|| StorageError::Backend {
                backend: "redis",
                reason: "UNLINK failed or the server is unreachable".into(),
            })?;
        }
        Ok(())
    }

    fn stats(&self) -> StorageStats {
        self.counters.snapshot()
    }
}
