//! `kvserve router --worker-urls` (regular mode) in front of real `kvserve serve` processes
//! on loopback: a worker killed mid-run is skipped within the health-check interval while
//! requests succeed on the others, `/add_worker` / `/remove_worker` / `/list_workers` at run
//! time, `cache_aware` keeping a prefix on one worker; and against mock workers: a 5xx is
//! retried once on another worker, a 4xx passes through, two failures are a 502 naming the
//! worker. Every process is killed on drop (also when a test fails), the router stops with
//! its guard.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::routing::{get, post};
use common::proc::Proc;
use engine::router::{spawn, BackgroundRouter, HealthConfig, PolicyKind, RouterConfig};
use serde_json::{json, Value};

/// A `kvserve serve` process (the tiny built-in model) and its port.
fn worker() -> (Proc, u16) {
    let p = Proc::spawn(&["serve", "--port", "0", "--threads", "1"]);
    let port = p.next_port();
    (p, port)
}

fn url(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

/// A router over `ports` with 1 s health checks that skip a worker after one failure.
fn router(ports: &[u16], policy: PolicyKind) -> (BackgroundRouter, u16) {
    let urls: Vec<String> = ports.iter().map(|p| url(*p)).collect();
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let mut cfg = RouterConfig::regular(&refs, policy).unwrap();
    cfg.health = HealthConfig {
        interval: Duration::from_secs(1),
        timeout: Duration::from_millis(500),
        failure_threshold: 1,
        success_threshold: 1,
    };
    let r = spawn(cfg, "127.0.0.1:0", 2).unwrap();
    let port = r.addr.port();
    (r, port)
}

fn generate(port: u16, text: &str) -> (u16, Value) {
    common::post(
        port,
        "/generate",
        json!({"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}),
    )
}

/// Requests the router sent to the worker on `worker_port`, from its metrics.
fn sent_to(router: u16, worker_port: u16) -> u64 {
    let (_, text) = common::http(router, "GET", "/metrics", "");
    let want = format!(
        "kvserve_router:worker_requests_total{{worker=\"{}\"}} ",
        url(worker_port)
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&want))
        .map_or(0, |n| n.parse().unwrap())
}

fn healthy(router: u16) -> Vec<(String, bool)> {
    common::get(router, "/list_workers")["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["url"].as_str().unwrap().to_string(),
                w["healthy"].as_bool().unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_killed_worker_is_skipped_within_the_interval_and_requests_succeed_elsewhere() {
    let (mut dead, dead_port) = worker();
    let (_a, a) = worker();
    let (b_proc, b) = worker();
    let (_r, rp) = router(&[dead_port, a, b], PolicyKind::RoundRobin);
    for i in 0..6 {
        let (status, v) = generate(rp, &format!("warm up {i}"));
        assert_eq!(status, 200, "{v}");
    }
    assert_eq!(
        sent_to(rp, dead_port),
        2,
        "round robin reached every worker"
    );
    // Killed with no traffic: within one interval (+ the probe's timeout) the checks mark it.
    dead.kill();
    let start = Instant::now();
    let dead_url = url(dead_port);
    while healthy(rp).iter().any(|(u, h)| *u == dead_url && *h) {
        assert!(start.elapsed() < Duration::from_secs(3), "still healthy");
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = sent_to(rp, dead_port);
    for i in 0..6 {
        let (status, v) = generate(rp, &format!("later {i}"));
        assert_eq!(status, 200, "{v}");
    }
    assert_eq!(sent_to(rp, dead_port), before, "nothing more sent to it");
    // Killed under traffic, before any check: the request that finds it dead is retried on
    // the last worker, and it is skipped from then on.
    let b_before = sent_to(rp, b);
    drop(b_proc);
    for i in 0..6 {
        let (status, v) = generate(rp, &format!("after the kill {i}"));
        assert_eq!(status, 200, "request {i}: {v}");
    }
    assert!(
        sent_to(rp, b) <= b_before + 1,
        "tried at most once after the kill"
    );

    // Run-time changes: remove the dead one, add a fresh worker, which gets requests.
    let (status, v) = common::post(rp, &format!("/remove_worker?url={dead_url}"), json!({}));
    assert_eq!(status, 200, "{v}");
    let (status, _) = common::post(rp, &format!("/remove_worker?url={dead_url}"), json!({}));
    assert_eq!(status, 404);
    let (_c, c) = worker();
    let (status, v) = common::post(rp, &format!("/add_worker?url={}", url(c)), json!({}));
    assert_eq!((status, &v["healthy"]), (200, &json!(true)), "{v}");
    let (status, _) = common::post(rp, &format!("/add_worker?url={}", url(c)), json!({}));
    assert_eq!(status, 400, "added twice");
    let (status, _) = common::post(rp, "/add_worker?url=nope", json!({}));
    assert_eq!(status, 400);
    let urls = common::get(rp, "/list_workers")["urls"].clone();
    assert_eq!(urls, json!([url(a), url(b), url(c)]));
    for i in 0..4 {
        assert_eq!(generate(rp, &format!("new {i}")).0, 200);
    }
    assert_eq!(sent_to(rp, c), 2, "round robin over a and c");
}

#[test]
fn cache_aware_sends_a_shared_prefix_to_one_worker() {
    let (_a, a) = worker();
    let (_b, b) = worker();
    let (_r, rp) = router(&[a, b], PolicyKind::CacheAware);
    let system = "You are a helpful assistant who answers in one short sentence. ".repeat(4);
    let mut cached = Vec::new();
    for q in [
        "what is rust?",
        "what is a radix tree?",
        "why cache prefixes?",
    ] {
        let (status, v) = generate(rp, &format!("{system}{q}"));
        assert_eq!(status, 200, "{v}");
        cached.push(v["meta_info"]["cached_tokens"].as_u64().unwrap());
    }
    assert_eq!(cached[0], 0);
    assert!(cached[1] > 0 && cached[2] > 0, "{cached:?}");
    let (x, y) = (sent_to(rp, a), sent_to(rp, b));
    assert_eq!((x + y, x.min(y)), (3, 0), "one worker got the whole group");
}

/// A mock worker answering `status` to every generation request, counting them.
async fn mock(status: u16) -> (u16, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let app = axum::Router::new()
        .route(
            "/generate",
            post(move || {
                let h = h.clone();
                async move {
                    h.fetch_add(1, SeqCst);
                    let code = StatusCode::from_u16(status).unwrap();
                    (code, axum::Json(json!({"text": "ok", "status": status})))
                }
            }),
        )
        .route("/health", get(|| async { StatusCode::OK }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(l, app).await });
    (port, hits)
}

async fn generate_async(c: &reqwest::Client, port: u16, body: Value) -> reqwest::Response {
    c.post(format!("http://127.0.0.1:{port}/generate"))
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_is_retried_once_elsewhere_and_a_4xx_passes_through() {
    let (bad, bad_hits) = mock(503).await;
    let (good, good_hits) = mock(200).await;
    let (_r, rp) = router(&[bad, good], PolicyKind::RoundRobin);
    let c = reqwest::Client::new();
    for _ in 0..4 {
        let r = generate_async(&c, rp, json!({"text": "x"})).await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(
        good_hits.load(SeqCst),
        4,
        "every request ended on the good worker"
    );
    // A 5xx does not take a worker out of rotation (it answered): tried again later.
    assert!((2..=4).contains(&bad_hits.load(SeqCst)), "{bad_hits:?}");
    drop(_r);

    let (bad2, _) = mock(500).await;
    let (_r, rp) = router(&[bad, bad2], PolicyKind::Random);
    let r = generate_async(&c, rp, json!({"text": "x"})).await;
    assert_eq!(r.status(), 502);
    let v: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("worker http://127.0.0.1:") && msg.contains("answered 5"),
        "{msg}"
    );
    drop(_r);

    let (four, four_hits) = mock(422).await;
    let (_r, rp) = router(&[four, good], PolicyKind::RoundRobin);
    let r = generate_async(&c, rp, json!({"text": "x"})).await;
    assert_eq!(r.status(), 422, "the client's error, not retried");
    assert_eq!(four_hits.load(SeqCst), 1);
    let (status, _) = common::http(rp, "POST", "/generate", "{not json");
    assert_eq!(status, 400);
}
