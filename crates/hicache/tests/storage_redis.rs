//! The `redis` L3 backend against real `redis-server`s on loopback: the conformance suite on
//! one server and on a three-node Redis Cluster, a server killed or frozen mid-run (misses
//! within the timeout, no panic, reconnection once it is back), a server that is down from
//! the start, and the configuration errors.
//!
//! Without `redis-server` on the PATH these tests print why and pass, unless
//! `KVSERVE_REQUIRE_REDIS=1` (set by CI), which makes a missing server a failure. Every
//! server is stopped by a guard's `Drop`, so a failing test leaves none behind.
#![cfg(feature = "redis")]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hicache::storage::testing::{check_storage, check_unreachable, random_keys, random_pages};
use hicache::storage::{
    open_storage, HiCacheRedis, HiCacheStorage, StorageConfig, StorageError, StorageKind,
    StorageNamespace,
};

/// Whether `redis-server` can run here; otherwise prints why the test is skipped, or panics
/// under `KVSERVE_REQUIRE_REDIS=1`.
fn redis_available() -> bool {
    tools_available(&["redis-server"])
}

/// Whether every one of `tools` runs (`--version`); see [`redis_available`].
fn tools_available(tools: &[&str]) -> bool {
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|tool| {
            !Command::new(tool)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect();
    if missing.is_empty() {
        return true;
    }
    if std::env::var("KVSERVE_REQUIRE_REDIS").as_deref() == Ok("1") {
        panic!("KVSERVE_REQUIRE_REDIS=1 but {missing:?} are not on the PATH");
    }
    eprintln!("skipping: {missing:?} not on the PATH (install redis-server to run this test)");
    false
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One `redis-server` child on a loopback port, without persistence; killed on drop.
struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    cluster: bool,
}

impl RedisServer {
    /// Starts a server on a free port (another one if that port is taken meanwhile).
    fn start(cluster: bool) -> Self {
        for _ in 0..5 {
            let port = free_port();
            let dir =
                std::env::temp_dir().join(format!("kvserve-redis-{}-{port}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let mut server = RedisServer {
                child: None,
                port,
                dir,
                cluster,
            };
            if server.try_restart() {
                return server;
            }
        }
        panic!("redis-server did not start on five free ports");
    }

    /// Starts the server again on its port and waits until it answers.
    fn restart(&mut self) {
        assert!(
            self.try_restart(),
            "redis-server did not restart on port {}",
            self.port
        );
    }

    /// Starts the server on its port; false if it exited (the port was taken) or never
    /// answered.
    fn try_restart(&mut self) -> bool {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes", "--cluster-config-file"])
                .arg(self.dir.join("nodes.conf"));
        }
        self.child = Some(cmd.spawn().expect("start redis-server"));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if !self.running() {
                self.child = None;
                return false;
            }
            if self.answers() {
                // Ours, not another test's server on a reused port: ours is still running.
                std::thread::sleep(Duration::from_millis(20));
                return self.running();
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    fn answers(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        client
            .get_connection_with_timeout(Duration::from_millis(200))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok()
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {}", self.pid());
    }

    fn dbsize(&self) -> i64 {
        let client = redis::Client::open(self.url()).unwrap();
        let mut conn = client.get_connection().unwrap();
        redis::cmd("DBSIZE").query(&mut conn).unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            // A frozen server must be resumed to die cleanly of SIGKILL's wait, too.
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn redis_config(json: &str) -> StorageConfig {
    StorageConfig::from_json(json).unwrap()
}

fn open(cfg: &StorageConfig, ns: &StorageNamespace, pb: usize) -> Arc<dyn HiCacheStorage> {
    match open_storage(StorageKind::Redis, cfg, ns, pb) {
        Ok(store) => store,
        Err(e) => panic!("open_storage(redis): {e}"),
    }
}

#[test]
fn one_server_passes_the_conformance_suite() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start(false);
    let cfg = redis_config(&format!(r#"{{"url": "{}"}}"#, server.url()));
    check_storage("redis", &mut |ns, pb| open(&cfg, ns, pb));
    let store = HiCacheRedis::open(&cfg, &StorageNamespace::from_prefix("x").unwrap(), 8).unwrap();
    assert!(!store.is_cluster());
}

#[test]
fn a_redis_cluster_passes_the_conformance_suite_and_spreads_pages() {
    if !tools_available(&["redis-server", "redis-cli"]) {
        return;
    }
    let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start(true)).collect();
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let created = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(created, "redis-cli --cluster create failed");
    // Wait until every node sees all slots covered.
    let deadline = Instant::now() + Duration::from_secs(20);
    for node in &nodes {
        let client = redis::Client::open(node.url()).unwrap();
        let mut conn = client.get_connection().unwrap();
        loop {
            let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut conn).unwrap();
            if info.contains("cluster_state:ok") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster never became ok: {info}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    let cfg = redis_config(&format!(r#"{{"urls": {urls:?}}}"#));
    check_storage("cluster", &mut |ns, pb| open(&cfg, ns, pb));

    let ns = StorageNamespace::from_prefix("spread").unwrap();
    let store = HiCacheRedis::open(&cfg, &ns, 32).unwrap();
    assert!(store.is_cluster());
    let keys = random_keys(11, 300);
    let pages = random_pages(12, 300, 32);
    store.batch_set(&keys, &pages).unwrap();
    let mut out = vec![0u8; 300 * 32];
    assert_eq!(store.batch_get(&keys, &mut out).unwrap(), 300);
    assert!(out == pages, "MGET across slots keeps the key order");
    for node in &nodes {
        assert!(
            node.dbsize() > 50,
            "node {} holds a share of the pages",
            node.port
        );
    }
    store.clear().unwrap();
    assert_eq!(
        nodes.iter().map(RedisServer::dbsize).sum::<i64>(),
        0,
        "clear reaches every node"
    );
}

#[test]
fn a_killed_server_is_a_miss_within_the_timeout_and_is_reconnected() {
    if !redis_available() {
        return;
    }
    let mut server = RedisServer::start(false);
    let cfg = redis_config(&format!(
        r#"{{"url": "{}", "connect_timeout_ms": 300, "io_timeout_ms": 500}}"#,
        server.url()
    ));
    let ns = StorageNamespace::from_prefix("kill").unwrap();
    let store = open(&cfg, &ns, 64);
    let keys = random_keys(1, 10);
    let pages = random_pages(2, 10, 64);
    store.batch_set(&keys, &pages).unwrap();
    assert_eq!(store.batch_exists(&keys), 10);

    server.kill();
    let started = Instant::now();
    check_unreachable(store.as_ref());
    assert_eq!(store.batch_exists(&keys), 0);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "a dead server answered as misses in {:?}",
        started.elapsed()
    );

    // Back on the same port (empty: no persistence): the backend reconnects by itself within
    // its backoff (at most 2 s between attempts).
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.batch_set(&keys, &pages).is_err() {
        assert!(Instant::now() < deadline, "the backend never reconnected");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut out = vec![0u8; 10 * 64];
    assert_eq!(store.batch_get(&keys, &mut out).unwrap(), 10);
    assert_eq!(out, pages);
}

#[test]
fn a_frozen_server_is_a_miss_within_the_io_timeout() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start(false);
    let cfg = redis_config(&format!(
        r#"{{"url": "{}", "connect_timeout_ms": 300, "io_timeout_ms": 400}}"#,
        server.url()
    ));
    let store = open(&cfg, &StorageNamespace::from_prefix("freeze").unwrap(), 16);
    let keys = random_keys(3, 4);
    store.batch_set(&keys, &random_pages(4, 4, 16)).unwrap();

    // SIGSTOP: the socket stays open and nothing answers, the worst case for a caller.
    server.signal("-STOP");
    let started = Instant::now();
    assert_eq!(store.batch_exists(&keys), 0);
    let first = started.elapsed();
    assert!(
        first < Duration::from_millis(1500),
        "one call took {first:?}"
    );
    let started = Instant::now();
    check_unreachable(store.as_ref());
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "four calls took {:?}",
        started.elapsed()
    );

    server.signal("-CONT");
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.batch_exists(&keys) != 4 {
        assert!(Instant::now() < deadline, "the backend never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_server_down_from_the_start_is_not_an_open_error() {
    // No redis-server needed: nothing listens on this port.
    let port = free_port();
    let cfg = redis_config(&format!(
        r#"{{"url": "redis://127.0.0.1:{port}", "connect_timeout_ms": 200, "io_timeout_ms": 200}}"#
    ));
    let started = Instant::now();
    let store = open(&cfg, &StorageNamespace::from_prefix("down").unwrap(), 8);
    check_unreachable(store.as_ref());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn redis_configuration_errors_are_typed() {
    let ns = StorageNamespace::from_prefix("cfg").unwrap();
    let err_of = |json: &str| match open_storage(StorageKind::Redis, &redis_config(json), &ns, 8) {
        Ok(_) => panic!("{json} opened"),
        Err(e) => e,
    };
    let err = err_of("{}");
    assert!(
        matches!(err, StorageError::InvalidConfig(_)) && err.to_string().contains("`url`"),
        "{err}"
    );
    let err = err_of(r#"{"url": "http://127.0.0.1:1"}"#);
    assert!(matches!(err, StorageError::InvalidConfig(_)), "{err}");
    let err = err_of(r#"{"url": "redis://127.0.0.1:1", "file_path": "/tmp/x"}"#);
    assert!(err.to_string().contains("file_path"), "{err}");
}

#[test]
fn large_pages_are_moved_a_few_per_command() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start(false);
    let cfg = redis_config(&format!(
        r#"{{"url": "{}", "io_timeout_ms": 10000}}"#,
        server.url()
    ));
    // 22 MiB pages: two per MGET / MSET (at most 64 MiB per command), so four pages take two.
    let pb = 22 << 20;
    let store = open(&cfg, &StorageNamespace::from_prefix("large").unwrap(), pb);
    let keys = random_keys(5, 4);
    let pages = random_pages(6, 4, pb);
    store.batch_set(&keys, &pages).unwrap();
    let mut out = vec![0u8; 4 * pb];
    assert_eq!(store.batch_get(&keys, &mut out).unwrap(), 4);
    assert!(out == pages, "large pages read back byte for byte");
    assert_eq!(store.stats().errors, 0);
}
