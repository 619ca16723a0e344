//! A `redis-server` child on a loopback port for the HiCache L3 tests, without persistence,
//! killed on drop (also when the test fails). Without `redis-server` on the PATH the caller
//! skips with a printed reason, unless `KVSERVE_REQUIRE_REDIS=1` (CI) makes that a failure.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `redis-server`.
pub struct Redis {
    child: Option<Child>,
    /// Its loopback port.
    pub port: u16,
}

impl Redis {
    /// Starts one, or `None` (skip) when `redis-server` is not installed.
    pub fn start() -> Option<Redis> {
        let installed = Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !installed {
            if std::env::var("KVSERVE_REQUIRE_REDIS").as_deref() == Ok("1") {
                panic!("KVSERVE_REQUIRE_REDIS=1 but redis-server is not on the PATH");
            }
            eprintln!("skipping: redis-server is not on the PATH (apt-get install redis-server)");
            return None;
        }
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server");
            let mut r = Redis {
                child: Some(child),
                port,
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && r.running() {
                if r.answers() {
                    return Some(r);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("redis-server did not start on five free ports");
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Whether it answers `PING` with `+PONG`.
    fn answers(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
        let mut buf = [0u8; 7];
        s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    /// Kills it (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}
