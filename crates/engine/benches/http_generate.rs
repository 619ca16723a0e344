//! Latency of a one-token `/generate` over HTTP on the tiny model: an in-process
//! `kvserve serve` on loopback, one keep-alive connection, an 8-token prompt and
//! `max_new_tokens: 1` (one prefill, one sampled token, the response). Beside it, the same
//! connection's `GET /health`, the HTTP round trip without the engine.
//!
//! After criterion's groups it prints the median and p99 of 1,000 further requests.
//!
//! Run: `cargo bench -p engine --bench http_generate`.

use std::hint::black_box;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use clap::Parser;
use criterion::Criterion;
use engine::cli::{Cli, Command};
use engine::commands::serve::build_server_state;

/// Starts the server on a thread.
fn serve() -> engine::server::BackgroundServer {
    let argv = ["kvserve", "serve", "--port", "0", "--threads", "1"];
    let Command::Serve(args) = Cli::parse_from(argv).command else {
        unreachable!()
    };
    let state = build_server_state(&args).expect("the tiny model");
    engine::server::spawn(state, "127.0.0.1:0", 1).expect("listen on loopback")
}

/// One keep-alive HTTP/1.1 connection.
struct Client {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
    body: Vec<u8>,
}

impl Client {
    fn connect(port: u16) -> Self {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        Client {
            reader: BufReader::new(s.try_clone().unwrap()),
            writer: s,
            body: Vec::new(),
        }
    }

    /// Sends a request and reads the whole response (a Content-Length body); returns the
    /// status.
    fn request(&mut self, method: &str, path: &str, body: &str) -> u16 {
        write!(
            self.writer,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        let status = line.split(' ').nth(1).unwrap().parse().unwrap();
        let mut len = 0;
        loop {
            line.clear();
            self.reader.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        self.body.resize(len, 0);
        self.reader.read_exact(&mut self.body).unwrap();
        status
    }
}

const GENERATE: &str = r#"{"input_ids": [464, 3139, 286, 4881, 318, 6342, 13, 383], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}"#;

fn main() {
    let server = serve();
    let mut client = Client::connect(server.addr.port());
    assert_eq!(client.request("POST", "/generate", GENERATE), 200);

    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("http");
    g.bench_function("generate_one_token", |b| {
        b.iter(|| black_box(client.request("POST", "/generate", GENERATE)))
    });
    g.bench_function("health_baseline", |b| {
        b.iter(|| black_box(client.request("GET", "/health", "")))
    });
    g.finish();
    c.final_summary();

    let mut times: Vec<Duration> = (0..1000)
        .map(|_| {
            let t = Instant::now();
            assert_eq!(client.request("POST", "/generate", GENERATE), 200);
            t.elapsed()
        })
        .collect();
    times.sort();
    println!(
        "one-token /generate over HTTP, 1000 requests: median {:?}, p99 {:?}, max {:?}",
        times[times.len() / 2],
        times[times.len() * 99 / 100],
        times[times.len() - 1]
    );
}
