//! What the server tests share: an in-process `kvserve serve` on loopback and a raw HTTP/1.1
//! client over `TcpStream`.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use clap::Parser;
use engine::cli::{Cli, Command};
use engine::commands::serve::build_server_state;
use engine::server::BackgroundServer;
use serde_json::Value;

/// A server on loopback, stopped on drop.
pub struct Server {
    /// Its port.
    pub port: u16,
    _server: BackgroundServer,
}

/// Starts `kvserve serve` in process with `extra` flags.
pub fn start(extra: &[&str]) -> Server {
    let mut argv = vec!["kvserve", "serve", "--port", "0", "--threads", "1"];
    argv.extend(extra);
    // As the binary does: a --config file's flags go in first.
    let argv = engine::config_file::expand_config(argv.into_iter().map(Into::into).collect())
        .expect("config file");
    let Command::Serve(args) = Cli::parse_from(argv).command else {
        unreachable!()
    };
    let server =
        engine::server::spawn(build_server_state(&args).unwrap(), "127.0.0.1:0", 2).unwrap();
    Server {
        port: server.addr.port(),
        _server: server,
    }
}

/// One HTTP/1.1 request; returns (status, body).
pub fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    http_with(port, method, path, &[], body)
}

/// One HTTP/1.1 request with extra headers; returns (status, body).
pub fn http_with(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status: u16 = raw.split(' ').nth(1).unwrap().parse().unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// POST a JSON body; the response parsed as JSON (a string when it is not).
pub fn post(port: u16, path: &str, body: Value) -> (u16, Value) {
    let (status, text) = http(port, "POST", path, &body.to_string());
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// GET a JSON endpoint that must answer 200.
pub fn get(port: u16, path: &str) -> Value {
    let (status, text) = http(port, "GET", path, "");
    assert_eq!(status, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap()
}

/// Waits until nothing runs or waits; returns `/get_server_info`.
pub fn wait_idle(port: u16) -> Value {
    for _ in 0..400 {
        let info = get(port, "/get_server_info");
        if info["engine"]["running"] == 0 && info["engine"]["waiting"] == 0 {
            return info;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the server did not go idle");
}

/// The `data:` payloads of a server-sent event stream.
pub fn sse_data(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect()
}

/// A request whose response body is streamed until the client closes it: writes the request
/// and reads the status line, then drops the connection.
pub fn disconnect_mid_stream(port: u16, path: &str, body: &str) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
}

/// After a client went away: the pool is consistent and nothing is left locked.
pub fn assert_kv_freed(port: u16) {
    let info = wait_idle(port);
    let e = &info["engine"];
    assert_eq!(e["ownership_ok"], true);
    assert_eq!(e["protected_tokens"], 0);
    assert_eq!(
        e["available_tokens"].as_u64().unwrap() + e["evictable_tokens"].as_u64().unwrap(),
        e["total_tokens"].as_u64().unwrap()
    );
}
/// Whether a test that runs Python with `modules` can run: when `python3` cannot import them,
/// prints why the test is skipped and returns false, or panics when `require_env` is set to 1
/// (CI installs them).
pub fn python_can_import(modules: &str, require_env: &str) -> bool {
    let Some(reason) = python_missing(modules) else {
        return true;
    };
    if std::env::var(require_env).as_deref() == Ok("1") {
        panic!("{require_env}=1 but {reason}");
    }
    eprintln!("skipping a test that needs Python's {modules}: {reason}");
    false
}

/// Whether `python3` can import `modules` (e.g. `"zmq, msgpack"`); the reason when it cannot.
fn python_missing(modules: &str) -> Option<String> {
    match std::process::Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .output()
    {
        Err(e) => Some(format!("python3 cannot be run: {e}")),
        Ok(o) if !o.status.success() => Some(format!(
            "a Python package ({modules}) is missing: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Ok(_) => None,
    }
}

pub mod pd;
pub mod proc;
pub mod redis;
