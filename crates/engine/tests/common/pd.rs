//! PD pairs for the tests: a prefill and a decode server in process, and requests sent to
//! both with one bootstrap room, as the router does.

use std::time::Duration;

use serde_json::{json, Value};

use super::{get, post, start, Server};

/// A prefill and a decode server on loopback.
pub struct Pair {
    pub prefill: Server,
    pub decode: Server,
    /// The prefill's bootstrap port.
    pub bootstrap_port: u16,
}

/// Starts a pair over `backend` with `prefill_flags` / `decode_flags` added.
pub fn pair(backend: &str, prefill_flags: &[&str], decode_flags: &[&str]) -> Pair {
    let mut pf = vec![
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-transfer-backend",
        backend,
        "--disaggregation-bootstrap-port",
        "0",
    ];
    pf.extend(prefill_flags);
    let prefill = start(&pf);
    let mut df = vec![
        "--disaggregation-mode",
        "decode",
        "--disaggregation-transfer-backend",
        backend,
    ];
    df.extend(decode_flags);
    let decode = start(&df);
    let bootstrap_port = bootstrap_port(prefill.port);
    Pair {
        prefill,
        decode,
        bootstrap_port,
    }
}

/// The bootstrap port a prefill server reports in `/get_server_info`.
pub fn bootstrap_port(port: u16) -> u16 {
    let info = get(port, "/get_server_info");
    let addr = info["engine"]["disaggregation"]["bootstrap_addr"]
        .as_str()
        .unwrap_or_else(|| panic!("no bootstrap address: {info}"))
        .to_string();
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

/// `body` with the bootstrap fields of `room`.
pub fn with_room(body: &Value, bootstrap_port: u16, room: u64) -> Value {
    let mut b = body.clone();
    b["bootstrap_host"] = json!("127.0.0.1");
    b["bootstrap_port"] = json!(bootstrap_port);
    b["bootstrap_room"] = json!(room);
    b
}

/// Sends `body` to both servers of `pair` at once with room `room`; returns (prefill, decode)
/// responses.
pub fn send(p: &Pair, path: &str, body: &Value, room: u64) -> ((u16, Value), (u16, Value)) {
    let b = with_room(body, p.bootstrap_port, room);
    let (pp, dp) = (p.prefill.port, p.decode.port);
    let path2 = path.to_string();
    let b2 = b.clone();
    let prefill = std::thread::spawn(move || post(pp, &path2, b2));
    let decode = post(dp, path, b);
    (prefill.join().unwrap(), decode)
}

/// Waits until a PD server's queues are empty and its scheduler idle; returns its
/// `/get_server_info`.
pub fn wait_pd_idle(port: u16) -> Value {
    for _ in 0..1000 {
        let info = get(port, "/get_server_info");
        let e = &info["engine"];
        let d = &e["disaggregation"];
        let queues = [
            "bootstrap_queue",
            "sending",
            "inflight_queue",
            "handshake_queue",
            "prealloc_queue",
            "transfer_queue",
            "draining",
        ];
        let pd_idle = queues.iter().all(|q| d[q].as_u64().unwrap_or(0) == 0);
        if pd_idle && e["running"] == 0 && e["waiting"] == 0 {
            return info;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!(
        "the server did not go idle: {}",
        get(port, "/get_server_info")
    );
}

/// Sends `body` to both servers with room `room` as [`send`] does, but waits only for the
/// decode server's answer; then the prefill request's client goes away (as the router's does
/// when decode fails).
pub fn send_and_drop_prefill(p: &Pair, path: &str, body: &Value, room: u64) -> (u16, Value) {
    use std::io::Write;
    let b = with_room(body, p.bootstrap_port, room).to_string();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", p.prefill.port)).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    )
    .unwrap();
    let decode = post(p.decode.port, path, with_room(body, p.bootstrap_port, room));
    drop(s);
    decode
}

/// `kvserve router --pd-disaggregation` in process over `p`, stopped on drop.
pub fn router(p: &Pair) -> engine::router::BackgroundRouter {
    router_to(p, &format!("http://127.0.0.1:{}", p.decode.port))
}

/// A router whose decode worker is `decode_url` (a dead one, for the error tests).
pub fn router_to(p: &Pair, decode_url: &str) -> engine::router::BackgroundRouter {
    let mut cfg = engine::router::RouterConfig::new(
        &format!("http://127.0.0.1:{}", p.prefill.port),
        decode_url,
    )
    .unwrap();
    cfg.prefill[0].bootstrap_port = p.bootstrap_port;
    engine::router::spawn(cfg, "127.0.0.1:0", 2).unwrap()
}

/// Both servers idle, every page free or cached, nothing locked, the ownership check passing.
pub fn assert_nothing_held(p: &Pair) {
    for port in [p.prefill.port, p.decode.port] {
        let info = wait_pd_idle(port);
        let e = &info["engine"];
        assert_eq!(e["ownership_ok"], true, "{info}");
        assert_eq!(e["protected_tokens"], 0, "{info}");
        assert_eq!(
            e["available_tokens"].as_u64().unwrap() + e["evictable_tokens"].as_u64().unwrap(),
            e["total_tokens"].as_u64().unwrap(),
            "{info}"
        );
    }
}
