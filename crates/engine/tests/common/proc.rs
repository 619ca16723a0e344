//! `kvserve` processes for the tests that kill servers: spawned from the built binary, their
//! printed addresses collected, killed on drop (also when the test fails).

use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::Duration;

/// A running `kvserve` process.
pub struct Proc {
    child: Child,
    addrs: Receiver<String>,
}

impl Proc {
    /// Spawns `kvserve args…`.
    pub fn spawn(args: &[&str]) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvserve"))
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvserve");
        let stderr = child.stderr.take().unwrap();
        let (tx, addrs) = channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(addr) = line.split("http://").nth(1) {
                    let _ = tx.send(addr.trim().to_string());
                }
            }
        });
        Proc { child, addrs }
    }

    /// The port of the next `http://host:port` line it prints (waits up to 2 minutes).
    pub fn next_port(&self) -> u16 {
        let addr = self
            .addrs
            .recv_timeout(Duration::from_secs(120))
            .expect("the process printed an address");
        addr.rsplit(':')
            .next()
            .unwrap()
            .trim_end_matches('/')
            .parse()
            .unwrap()
    }

    /// Kills it at once (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}
