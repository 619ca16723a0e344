//! PD servers that die: the built `kvserve` binary as prefill and decode processes, one of
//! them SIGKILLed while a request's KV moves. The survivor fails the request with a clear error
//! within its timeout (the decode side: within the heartbeat window) and frees every page and
//! row.

mod common;

use std::time::{Duration, Instant};

use common::pd::with_room;
use common::proc::Proc;
use common::{get, post};
use serde_json::{json, Value};

fn prefill_proc(extra: &[&str]) -> (Proc, u16, u16) {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--threads",
        "1",
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        "0",
    ];
    args.extend(extra);
    let p = Proc::spawn(&args);
    let bootstrap = p.next_port();
    let http = p.next_port();
    (p, http, bootstrap)
}

fn decode_proc(extra: &[&str]) -> (Proc, u16) {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--threads",
        "1",
        "--disaggregation-mode",
        "decode",
    ];
    args.extend(extra);
    let p = Proc::spawn(&args);
    let http = p.next_port();
    (p, http)
}

/// A long prompt in small chunks: its KV moves over many steps.
fn long_request() -> Value {
    let ids: Vec<u32> = (0..1500).map(|i| 300 + (i * 11) % 4000).collect();
    json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": true}})
}

/// Polls `port`'s PD queue `queue` until it is at least 1.
fn wait_queue(port: u16, queue: &str) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        let info = get(port, "/get_server_info");
        if info["engine"]["disaggregation"][queue]
            .as_u64()
            .unwrap_or(0)
            >= 1
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    panic!("{queue} never held a request");
}

/// Waits (up to `within`) until nothing is queued, running or held, and every page is free or
/// cached; returns how long it took.
fn wait_freed(port: u16, within: Duration) -> Duration {
    let start = Instant::now();
    let mut last = Value::Null;
    while start.elapsed() < within {
        let info = get(port, "/get_server_info");
        let e = &info["engine"];
        let d = &e["disaggregation"];
        let pd_idle = d
            .as_object()
            .map(|m| {
                m.iter()
                    .filter(|(k, _)| k.ends_with("queue") || *k == "sending" || *k == "draining")
                    .all(|(_, v)| v.as_u64() == Some(0))
            })
            .unwrap_or(false);
        if pd_idle
            && e["running"] == 0
            && e["waiting"] == 0
            && e["ownership_ok"] == true
            && e["protected_tokens"] == 0
            && e["available_tokens"].as_u64().unwrap() + e["evictable_tokens"].as_u64().unwrap()
                == e["total_tokens"].as_u64().unwrap()
        {
            return start.elapsed();
        }
        last = info;
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("not freed within {within:?}: {last}");
}

#[test]
fn killing_the_decode_server_mid_transfer_frees_the_prefill_side() {
    let (_prefill, pport, bport) = prefill_proc(&["--chunked-prefill-size", "16"]);
    let (mut decode, dport) = decode_proc(&[]);
    let body = with_room(&long_request(), bport, 77);
    let b = body.clone();
    let client = std::thread::spawn(move || post(pport, "/generate", b));
    let b = body.clone();
    let _decode_client = std::thread::spawn(move || {
        let _ = std::panic::catch_unwind(|| post(dport, "/generate", b));
    });
    wait_queue(pport, "sending");
    decode.kill();
    let took = wait_freed(pport, Duration::from_secs(30));
    let (status, r) = client.join().unwrap();
    assert_ne!(status, 200, "{r}");
    assert!(r.to_string().contains("transfer"), "{r}");
    eprintln!("prefill side freed {took:?} after the decode server died");
}

#[test]
fn killing_the_prefill_server_fails_decode_requests_within_the_heartbeat_window() {
    let (mut prefill, pport, bport) = prefill_proc(&["--chunked-prefill-size", "16"]);
    let (_decode, dport) = decode_proc(&[
        "--disaggregation-heartbeat-interval",
        "0.5",
        "--disaggregation-heartbeat-max-failures",
        "2",
    ]);
    let body = with_room(&long_request(), bport, 78);
    let b = body.clone();
    let _prefill_client = std::thread::spawn(move || {
        let _ = std::panic::catch_unwind(|| post(pport, "/generate", b));
    });
    let b = body.clone();
    let client = std::thread::spawn(move || post(dport, "/generate", b));
    wait_queue(dport, "transfer_queue");
    let killed = Instant::now();
    prefill.kill();
    let (status, r) = client.join().unwrap();
    let answered = killed.elapsed();
    assert_ne!(status, 200, "{r}");
    assert!(r.to_string().contains("transfer"), "{r}");
    // Two missed heartbeats of 0.5 s, with slack for a loaded machine.
    assert!(
        answered < Duration::from_secs(5),
        "answered after {answered:?}"
    );
    wait_freed(dport, Duration::from_secs(10));
}

#[test]
fn the_router_answers_with_an_error_when_the_prefill_dies_mid_request() {
    let (mut prefill, pport, bport) = prefill_proc(&["--chunked-prefill-size", "16"]);
    let (_decode, dport) = decode_proc(&["--disaggregation-heartbeat-interval", "0.5"]);
    let mut cfg = engine::router::RouterConfig::new(
        &format!("http://127.0.0.1:{pport}"),
        &format!("http://127.0.0.1:{dport}"),
    )
    .unwrap();
    cfg.prefill[0].bootstrap_port = bport;
    let router = engine::router::spawn(cfg, "127.0.0.1:0", 2).unwrap();
    let rport = router.addr.port();
    let client = std::thread::spawn(move || post(rport, "/generate", long_request()));
    wait_queue(dport, "transfer_queue");
    let killed = Instant::now();
    prefill.kill();
    let (status, r) = client.join().unwrap();
    assert_eq!(status, 502, "{r}");
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "{:?}",
        killed.elapsed()
    );
    wait_freed(dport, Duration::from_secs(10));
}
