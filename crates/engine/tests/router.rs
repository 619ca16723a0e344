//! `kvserve router --pd-disaggregation` against mock prefill and decode servers (axum, in this
//! file) that record the bodies they get: the injected bootstrap fields, decode's answer with
//! the prefill's cached tokens merged in, streaming passthrough, round-robin order, dead and
//! failing workers, client disconnects, `/health`, `/metrics`, `/get_server_info`, and the
//! binary's flags. Everything listens on 127.0.0.1 port 0 and stops when its guard drops (the
//! mocks with the test's runtime, the router with its `BackgroundRouter`, the binary with a
//! guard that kills it).

use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use engine::router::{spawn, BackgroundRouter, PolicyKind, PrefillWorker, RouterConfig, WorkerUrl};
use futures_util::stream;
use serde_json::{json, Value};
use tokio::sync::Notify;

/// How a mock worker answers the generation routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A prefill server: one JSON answer with `cached` cached tokens.
    Prefill,
    /// A decode server: JSON, or three SSE events then `[DONE]` when `stream` is set.
    Decode,
    /// A decode server whose stream sends one event, then waits for `release`.
    GatedDecode,
    /// A decode server whose stream sends one event and never ends.
    EndlessDecode,
    /// Answers this status with a JSON error.
    Status(u16),
    /// Answers 200 with HTML.
    NotJson,
    /// A decode server whose stream's second event is not JSON.
    BadSse,
    /// Never answers.
    Hang,
    /// Answers 500 after 300 ms.
    SlowFail,
}

/// A mock worker: what it got, and how many of its answers were dropped unfinished.
struct Mock {
    kind: Kind,
    cached: u64,
    got: Mutex<Vec<(String, Value)>>,
    dropped: Arc<AtomicUsize>,
    release: Notify,
    port: u16,
}

impl Mock {
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
    fn bodies(&self) -> Vec<(String, Value)> {
        self.got.lock().unwrap().clone()
    }
}

/// Counts a drop that happens before `done` is set.
struct OnDrop(Arc<AtomicUsize>);
impl Drop for OnDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, SeqCst);
    }
}

fn answer(path: &str, cached: u64, text: &str) -> Value {
    if path == "/generate" {
        json!({"text": text, "meta_info": {"prompt_tokens": 10, "completion_tokens": 3,
            "cached_tokens": cached, "finish_reason": {"type": "length"}}})
    } else {
        json!({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "text": text}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
            "prompt_tokens_details": {"cached_tokens": cached}}})
    }
}

fn sse(events: Vec<String>) -> Bytes {
    Bytes::from(
        events
            .iter()
            .map(|e| format!("data: {e}\n\n"))
            .collect::<String>(),
    )
}

/// Decode's events: `/generate` sends the answer so far each time; the OpenAI routes send
/// chunks with `usage: null` and a final usage chunk.
fn events(path: &str) -> Vec<String> {
    let mut out: Vec<String> = if path == "/generate" {
        ["a", "ab", "abc"]
            .iter()
            .map(|t| answer(path, 0, t).to_string())
            .collect()
    } else {
        let mut v: Vec<String> = ["a", "b", "c"]
            .iter()
            .map(|t| json!({"choices": [{"index": 0, "text": t}], "usage": null}).to_string())
            .collect();
        v.push(json!({"choices": [], "usage": answer(path, 0, "")["usage"]}).to_string());
        v
    };
    out.push("[DONE]".into());
    out
}

async fn handle(State(m): State<Arc<Mock>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let bytes = axum::body::to_bytes(req.into_body(), 1 << 20)
        .await
        .unwrap();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    m.got.lock().unwrap().push((path.clone(), body.clone()));
    let stream = body["stream"].as_bool().unwrap_or(false);
    match m.kind {
        Kind::Prefill => axum::Json(answer(&path, m.cached, "P")).into_response(),
        Kind::Decode if !stream => axum::Json(answer(&path, 0, "abc")).into_response(),
        Kind::Decode => {
            ([("content-type", "text/event-stream")], sse(events(&path))).into_response()
        }
        Kind::GatedDecode | Kind::EndlessDecode => {
            let all = events(&path);
            let first = sse(all[..1].to_vec());
            let rest = sse(all[1..].to_vec());
            let guard = OnDrop(m.dropped.clone());
            let body = stream::unfold((0, m.clone(), Some(guard)), move |(i, m, mut guard)| {
                let (first, rest) = (first.clone(), rest.clone());
                async move {
                    match i {
                        0 => Some((Ok::<_, Infallible>(first), (1, m, guard))),
                        1 if m.kind == Kind::GatedDecode => {
                            m.release.notified().await;
                            // Finished normally: not a drop.
                            std::mem::forget(guard.take());
                            Some((Ok(rest), (2, m, None)))
                        }
                        1 => {
                            std::future::pending::<()>().await;
                            None
                        }
                        _ => None,
                    }
                }
            });
            (
                [("content-type", "text/event-stream")],
                Body::from_stream(body),
            )
                .into_response()
        }
        Kind::Status(code) => (
            StatusCode::from_u16(code).unwrap(),
            axum::Json(json!({"error": {"message": format!("mock says {code}")}})),
        )
            .into_response(),
        Kind::NotJson => "<html>oops</html>".into_response(),
        Kind::BadSse => (
            [("content-type", "text/event-stream")],
            "data: {\"choices\": [], \"usage\": null}\n\ndata: oops\n\ndata: [DONE]\n\n",
        )
            .into_response(),
        Kind::SlowFail => {
            tokio::time::sleep(Duration::from_millis(300)).await;
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
        Kind::Hang => {
            let _guard = OnDrop(m.dropped.clone());
            std::future::pending::<Response>().await
        }
    }
}

/// Starts a mock on the current runtime (it stops with the runtime).
async fn mock(kind: Kind, cached: u64) -> Arc<Mock> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let m = Arc::new(Mock {
        kind,
        cached,
        got: Mutex::default(),
        dropped: Arc::default(),
        release: Notify::new(),
        port: listener.local_addr().unwrap().port(),
    });
    let app = axum::Router::new()
        .route("/generate", post(handle))
        .route("/v1/completions", post(handle))
        .route("/v1/chat/completions", post(handle))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/flush_cache", post(|| async { StatusCode::OK }))
        .route(
            "/get_server_info",
            get(|| async { axum::Json(json!({"mock": true})) }),
        )
        .route(
            "/v1/models",
            get(|| async { axum::Json(json!({"object": "list", "data": [{"id": "tiny"}]})) }),
        )
        .with_state(m.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    m
}

/// A port nothing listens on.
fn dead_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn config(prefill: &[(&str, u16)], decode: &[&str], policy: PolicyKind) -> RouterConfig {
    RouterConfig {
        prefill: prefill
            .iter()
            .map(|(u, p)| PrefillWorker {
                url: WorkerUrl::parse(u).unwrap(),
                bootstrap_port: *p,
            })
            .collect(),
        decode: decode
            .iter()
            .map(|u| WorkerUrl::parse(u).unwrap())
            .collect(),
        prefill_policy: policy,
        decode_policy: policy,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(30),
        tokenizer: None,
        ..RouterConfig::new("http://unused:1", "http://unused:2").unwrap()
    }
}

fn router(
    prefill: &[(&str, u16)],
    decode: &[&str],
    policy: PolicyKind,
) -> (BackgroundRouter, String) {
    let r = spawn(config(prefill, decode, policy), "127.0.0.1:0", 2).unwrap();
    let base = format!("http://{}", r.addr);
    (r, base)
}

/// One prefill mock (`kind`, `cached`) and one decode mock behind a random-policy router.
async fn one_pair(
    prefill: Kind,
    cached: u64,
    decode: Kind,
) -> (Arc<Mock>, Arc<Mock>, BackgroundRouter, String) {
    let (p, d) = (mock(prefill, cached).await, mock(decode, 0).await);
    let (r, base) = router(&[(&p.url(), 8998)], &[&d.url()], PolicyKind::Random);
    (p, d, r, base)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

async fn post_json(url: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Reads a whole SSE answer into its data payloads.
async fn post_stream(url: &str, body: &Value) -> (u16, Vec<String>) {
    let r = client()
        .post(url)
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let data = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect();
    (status, data)
}

/// Replaces the numbers that change from run to run.
fn redact(text: &str, ports: &[u16]) -> String {
    let mut s = text.to_string();
    for (i, p) in ports.iter().enumerate() {
        s = s.replace(&format!(":{p}"), &format!(":<port{i}>"));
    }
    s
}

fn room_of(v: &Value) -> u64 {
    v["bootstrap_room"].as_u64().expect("bootstrap_room")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_injects_one_room_into_both_and_answers_from_decode() {
    let p = mock(Kind::Prefill, 37).await;
    let d = mock(Kind::Decode, 0).await;
    let (_r, base) = router(&[(&p.url(), 9123)], &[&d.url()], PolicyKind::Random);
    let (status, answer) = post_json(
        &format!("{base}/generate"),
        &json!({"text": "hello", "sampling_params": {"max_new_tokens": 3}, "bootstrap_room": 1}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let (pb, db) = (p.bodies(), d.bodies());
    assert_eq!((pb.len(), db.len()), (1, 1));
    let room = room_of(&pb[0].1);
    assert_eq!(room, room_of(&db[0].1), "the same room goes to both");
    assert!(
        room <= i64::MAX as u64 && room != 1,
        "the router draws the room"
    );
    let mut shown = json!({"prefill_got": pb[0], "decode_got": db[0], "answer": answer});
    for who in ["prefill_got", "decode_got"] {
        shown[who][1]["bootstrap_room"] = json!("<room>");
    }
    insta::assert_snapshot!(serde_json::to_string_pretty(&shown).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_aware_prefill_policy_keeps_a_prefix_on_one_prefill_server() {
    let (p0, p1) = (mock(Kind::Prefill, 0).await, mock(Kind::Prefill, 0).await);
    let d = mock(Kind::Decode, 0).await;
    let mut cfg = config(
        &[(&p0.url(), 8998), (&p1.url(), 8998)],
        &[&d.url()],
        PolicyKind::RoundRobin,
    );
    cfg.prefill_policy = PolicyKind::CacheAware;
    let r = spawn(cfg, "127.0.0.1:0", 2).unwrap();
    let base = format!("http://{}", r.addr);
    for text in [
        "alpha: one",
        "beta: one",
        "alpha: two",
        "beta: two",
        "alpha: three",
    ] {
        let (status, v) = post_json(&format!("{base}/generate"), &json!({"text": text})).await;
        assert_eq!(status, 200, "{v}");
    }
    let texts = |m: &Mock| -> Vec<String> {
        m.bodies()
            .iter()
            .map(|(_, b)| b["text"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(texts(&p0), ["alpha: one", "alpha: two", "alpha: three"]);
    assert_eq!(texts(&p1), ["beta: one", "beta: two"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_answers_take_the_prefill_cached_tokens() {
    let (p, _d, _r, base) = one_pair(Kind::Prefill, 48, Kind::Decode).await;
    for route in ["/v1/completions", "/v1/chat/completions"] {
        let (status, answer) = post_json(
            &format!("{base}{route}"),
            &json!({"model": "m", "prompt": "hi"}),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(
            answer["usage"]["prompt_tokens_details"]["cached_tokens"],
            json!(48),
            "{route}"
        );
        assert_eq!(
            answer["choices"][0]["text"],
            json!("abc"),
            "decode's answer"
        );
    }
    let rooms: Vec<u64> = p.bodies().iter().map(|(_, b)| room_of(b)).collect();
    assert_ne!(rooms[0], rooms[1], "a room per request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_relayed_with_cached_tokens_merged() {
    let (p, d, _r, base) = one_pair(Kind::Prefill, 21, Kind::Decode).await;
    let (status, events) = post_stream(
        &format!("{base}/generate"),
        &json!({"text": "x", "stream": true}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(events.len(), 4, "{events:?}");
    assert_eq!(events[3], "[DONE]");
    for e in &events[..3] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert_eq!(v["meta_info"]["cached_tokens"], json!(21), "{e}");
    }
    assert_eq!(
        serde_json::from_str::<Value>(&events[2]).unwrap()["text"],
        json!("abc")
    );
    // The prefill's copy is not streamed; decode's is.
    assert_eq!(p.bodies()[0].1["stream"], json!(false));
    assert_eq!(d.bodies()[0].1["stream"], json!(true));

    let body = json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": true}});
    let (_, events) = post_stream(&format!("{base}/v1/completions"), &body).await;
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(
        chunks[..3].iter().all(|c| c["usage"].is_null()),
        "{chunks:?}"
    );
    assert_eq!(
        chunks[3]["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(21)
    );
    assert_eq!(p.bodies()[1].1.get("stream_options"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_events_pass_through_as_they_arrive() {
    let (_p, d, _r, base) = one_pair(Kind::Prefill, 5, Kind::GatedDecode).await;
    let mut resp = client()
        .post(format!("{base}/generate"))
        .body(json!({"text": "x", "stream": true}).to_string())
        .send()
        .await
        .unwrap();
    // Decode holds back the rest until the first event reached the client.
    let first = tokio::time::timeout(Duration::from_secs(10), resp.chunk())
        .await
        .expect("the first event arrives before decode ends its stream")
        .unwrap()
        .unwrap();
    let first = String::from_utf8_lossy(&first).to_string();
    assert!(
        first.starts_with("data: ") && first.contains("\"cached_tokens\":5"),
        "{first}"
    );
    d.release.notify_one();
    let mut rest = String::new();
    while let Some(c) = resp.chunk().await.unwrap() {
        rest.push_str(&String::from_utf8_lossy(&c));
    }
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
    assert_eq!(rest.matches("\"cached_tokens\":5").count(), 2, "{rest}");
}

/// PD decode servers are chosen by the same policies as prefill ones: with `cache_aware` a
/// group's prompts share a decode server (and a prefill server), the other group goes to the
/// other (the one with the smaller tree).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_keeps_a_prefix_on_one_prefill_and_one_decode_worker() {
    let (p0, p1) = (mock(Kind::Prefill, 0).await, mock(Kind::Prefill, 0).await);
    let (d0, d1) = (mock(Kind::Decode, 0).await, mock(Kind::Decode, 0).await);
    let (_r, base) = router(
        &[(&p0.url(), 9001), (&p1.url(), 9002)],
        &[&d0.url(), &d1.url()],
        PolicyKind::CacheAware,
    );
    let groups = [
        "You are a pirate who answers every question in rhyme. ",
        "Translate the following sentence into formal French: ",
    ];
    let mut seen = Vec::new();
    for i in 0..8 {
        let text = format!("{}question {i}", groups[[0, 1, 1, 0, 0, 1, 0, 1][i]]);
        let (status, _) = post_json(&format!("{base}/generate"), &json!({"text": text})).await;
        assert_eq!(status, 200);
        let who = |ms: [&Mock; 2]| {
            ms.iter()
                .position(|m| m.bodies().iter().any(|(_, b)| b["text"] == json!(text)))
                .unwrap()
        };
        seen.push((who([&p0, &p1]), who([&d0, &d1])));
    }
    let (a, b) = (seen[0], seen[1]);
    assert!(a.0 != b.0 && a.1 != b.1, "{seen:?}");
    let want: Vec<_> = [0, 1, 1, 0, 0, 1, 0, 1]
        .iter()
        .map(|&g| if g == 0 { a } else { b })
        .collect();
    assert_eq!(seen, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_alternates_prefill_and_decode_workers() {
    let (p0, p1) = (mock(Kind::Prefill, 0).await, mock(Kind::Prefill, 0).await);
    let (d0, d1) = (mock(Kind::Decode, 0).await, mock(Kind::Decode, 0).await);
    let (_r, base) = router(
        &[(&p0.url(), 9001), (&p1.url(), 9002)],
        &[&d0.url(), &d1.url()],
        PolicyKind::RoundRobin,
    );
    let mut order = Vec::new();
    for i in 0..4 {
        let (status, _) =
            post_json(&format!("{base}/generate"), &json!({"text": i.to_string()})).await;
        assert_eq!(status, 200);
        let who = |ms: [&Mock; 2]| {
            ms.iter()
                .position(|m| {
                    m.bodies()
                        .iter()
                        .any(|(_, b)| b["text"] == json!(i.to_string()))
                })
                .unwrap()
        };
        order.push((who([&p0, &p1]), who([&d0, &d1])));
    }
    assert_eq!(order, [(0, 0), (1, 1), (0, 0), (1, 1)]);
    let ports: Vec<Value> = p1
        .bodies()
        .iter()
        .map(|(_, b)| b["bootstrap_port"].clone())
        .collect();
    assert_eq!(
        ports,
        [json!(9002), json!(9002)],
        "each prefill's own bootstrap port"
    );
}

/// Waits until `done()` holds, at most `limit`; whether it did.
async fn until(limit: Duration, done: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Waits until `n` reaches `want`, at most `limit`.
async fn wait_for(n: &AtomicUsize, want: usize, limit: Duration) -> bool {
    until(limit, || n.load(SeqCst) >= want).await
}

/// Waits until `m` got `want` requests, at most `limit`.
async fn got_requests(m: &Mock, want: usize, limit: Duration) -> bool {
    until(limit, || m.bodies().len() >= want).await
}

/// Whether every request `m` got is dropped unanswered within 5 s (a request cancelled
/// before it was sent never arrives: nothing to drop).
async fn all_dropped(m: &Mock) -> bool {
    until(Duration::from_secs(5), || {
        m.dropped.load(SeqCst) == m.bodies().len()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_is_a_502_within_a_bound_and_the_other_request_is_dropped() {
    let dead = format!("http://127.0.0.1:{}", dead_port());
    // Dead prefill: decode (which would wait for KV forever) is cancelled.
    let d = mock(Kind::Hang, 0).await;
    let (r, base) = router(&[(&dead, 8998)], &[&d.url()], PolicyKind::Random);
    for stream in [false, true] {
        let start = Instant::now();
        let (status, answer) = post_json(
            &format!("{base}/generate"),
            &json!({"text": "x", "stream": stream}),
        )
        .await;
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(status, 502, "{answer}");
        let msg = answer["error"]["message"].as_str().unwrap();
        assert!(
            msg.starts_with(&format!("prefill worker {dead} could not be reached")),
            "{msg}"
        );
        assert_eq!(answer["error"]["code"], json!("prefill_error"));
    }
    assert!(all_dropped(&d).await, "decode requests not dropped");
    drop(r);

    // Dead decode: the prefill request is dropped.
    let p = mock(Kind::Hang, 0).await;
    let (_r, base) = router(&[(&p.url(), 8998)], &[&dead], PolicyKind::Random);
    let (status, answer) = post_json(
        &format!("{base}/v1/chat/completions"),
        &json!({"messages": []}),
    )
    .await;
    assert_eq!(status, 502);
    let msg = answer["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with(&format!("decode worker {dead} could not be reached")),
        "{msg}"
    );
    assert!(all_dropped(&p).await, "prefill request not dropped");

    // A prefill that fails after decode got its request: decode's request is dropped, so a
    // kvserve decode server frees its preallocation.
    let (_p, d, _r, base) = one_pair(Kind::SlowFail, 0, Kind::Hang).await;
    for stream in [false, true] {
        let (status, _) = post_json(
            &format!("{base}/generate"),
            &json!({"text": "x", "stream": stream}),
        )
        .await;
        assert_eq!(status, 502);
    }
    assert_eq!(d.bodies().len(), 2);
    assert!(
        wait_for(&d.dropped, 2, Duration::from_secs(5)).await,
        "decode requests not dropped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_errors_name_the_worker_and_4xx_passes_through() {
    let cases = [
        // A decode server waits for the prefill's KV, so a failing prefill answers first.
        (
            Kind::Status(500),
            Kind::Hang,
            502,
            "prefill worker",
            "answered 500 Internal Server Error",
        ),
        (
            Kind::Prefill,
            Kind::Status(503),
            502,
            "decode worker",
            "answered 503",
        ),
        (
            Kind::NotJson,
            Kind::Hang,
            502,
            "prefill worker",
            "not JSON: \"<html>oops</html>\"",
        ),
        (
            Kind::Prefill,
            Kind::NotJson,
            502,
            "decode worker",
            "not JSON",
        ),
        (Kind::Prefill, Kind::Status(400), 400, "", "mock says 400"),
    ];
    for (pk, dk, want, who, what) in cases {
        let (_p, _d, _r, base) = one_pair(pk, 0, dk).await;
        for stream in [false, true] {
            let url = format!("{base}/generate");
            let (status, answer) = post_json(&url, &json!({"text": "x", "stream": stream})).await;
            // A stream that decode started before the prefill failed ends with an error event.
            let (status, answer) = match answer.as_str() {
                Some(sse) if stream && status == 200 => {
                    let e = sse.strip_prefix("data: ").unwrap_or_default().trim_end();
                    (502, serde_json::from_str(e).unwrap_or(Value::Null))
                }
                _ => (status, answer),
            };
            let msg = answer["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            assert_eq!(status, want, "{pk:?} {dk:?}: {answer}");
            assert!(
                msg.starts_with(who) && msg.contains(what),
                "{pk:?} {dk:?}: {msg}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_failure_after_decode_answered_leaves_the_answer_standing() {
    let (p, _d, _r, base) = one_pair(Kind::SlowFail, 0, Kind::Decode).await;
    let (status, answer) = post_json(&format!("{base}/generate"), &json!({"text": "x"})).await;
    assert_eq!((status, &answer["text"]), (200, &json!("abc")), "{answer}");
    let metrics = client()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap();
    let want = format!(
        "kvserve_router:pd_prefill_errors_total{{worker=\"{}\"}} 1",
        p.url()
    );
    assert!(metrics.text().await.unwrap().contains(&want));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_event_that_is_not_json_ends_the_stream_with_an_error_event() {
    let (_p, d, _r, base) = one_pair(Kind::Prefill, 0, Kind::BadSse).await;
    let (status, events) = post_stream(
        &format!("{base}/v1/completions"),
        &json!({"prompt": "x", "stream": true}),
    )
    .await;
    assert_eq!((status, events.len()), (200, 2), "{events:?}");
    let err: Value = serde_json::from_str(&events[1]).unwrap();
    let msg = err["error"]["message"].as_str().unwrap();
    assert_eq!(
        msg,
        format!(
            "decode worker {} answered something that is not JSON: \"oops\"",
            d.url()
        )
    );
    assert_eq!(err["error"]["code"], json!("decode_error"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_drops_both_upstream_requests() {
    let (p, d, _r, base) = one_pair(Kind::Hang, 0, Kind::EndlessDecode).await;
    let mut resp = client()
        .post(format!("{base}/v1/chat/completions"))
        .body(json!({"messages": [], "stream": true}).to_string())
        .send()
        .await
        .unwrap();
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("\"usage\":null"));
    // The router sends both requests at once, but decode's first event can reach the client
    // before the prefill mock has read its request: dropping the client then cancels a
    // request the prefill never got (nothing to count as dropped). Wait until it has it (the
    // mock counts a drop from the moment it records the body, in the same poll).
    assert!(
        got_requests(&p, 1, Duration::from_secs(5)).await,
        "prefill request never arrived"
    );
    drop(resp);
    assert!(
        wait_for(&d.dropped, 1, Duration::from_secs(5)).await,
        "decode stream not dropped"
    );
    assert!(
        wait_for(&p.dropped, 1, Duration::from_secs(5)).await,
        "prefill request not dropped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_gives_up_on_an_unstreamed_request_drops_both_upstream_requests() {
    let (p, d, _r, base) = one_pair(Kind::Hang, 0, Kind::Hang).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let sent = impatient
        .post(format!("{base}/generate"))
        .body(json!({"text": "x"}).to_string());
    assert!(sent.send().await.unwrap_err().is_timeout());
    assert!(
        wait_for(&d.dropped, 1, Duration::from_secs(5)).await,
        "decode request not dropped"
    );
    assert!(
        wait_for(&p.dropped, 1, Duration::from_secs(5)).await,
        "prefill request not dropped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_metrics_models_and_server_info() {
    let p = mock(Kind::Prefill, 3).await;
    let d = mock(Kind::Decode, 0).await;
    let dead = format!("http://127.0.0.1:{}", dead_port());
    let (_r, base) = router(
        &[(&p.url(), 9000)],
        &[&d.url(), &dead],
        PolicyKind::RoundRobin,
    );
    let c = client();
    assert_eq!(
        c.get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    post_json(&format!("{base}/generate"), &json!({"text": "a"})).await; // d: ok
    post_json(&format!("{base}/generate"), &json!({"text": "b"})).await; // dead: 502
    post_json(&format!("{base}/generate"), &json!([1, 2])).await; // 400
    let models: Value = c
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json_text()
        .await;
    assert_eq!(models["data"][0]["id"], json!("tiny"));

    let metrics = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let counters: String = metrics
        .lines()
        .filter(|l| !l.contains("_bucket") && !l.contains("_sum"))
        .map(|l| format!("{l}\n"))
        .collect();
    let ports = [
        p.port,
        d.port,
        dead.rsplit(':').next().unwrap().parse().unwrap(),
    ];
    insta::assert_snapshot!("metrics", redact(&counters, &ports));
    assert!(metrics.contains(
        "kvserve_router:pd_request_duration_seconds_bucket{route=\"/generate\",le=\"+Inf\"} 3"
    ));

    let info: Value = c
        .get(format!("{base}/get_server_info"))
        .send()
        .await
        .unwrap()
        .json_text()
        .await;
    let mut info = info;
    let err = std::mem::replace(&mut info["decode"][1]["error"], json!("<checked above>"));
    let want = format!("decode worker {dead} could not be reached: ");
    assert!(err.as_str().unwrap().starts_with(&want), "{err}");
    insta::assert_snapshot!(
        "server_info",
        redact(&serde_json::to_string_pretty(&info).unwrap(), &ports)
    );
}

trait JsonText {
    async fn json_text(self) -> Value;
}
impl JsonText for reqwest::Response {
    async fn json_text(self) -> Value {
        serde_json::from_str(&self.text().await.unwrap()).unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_are_400_and_reach_no_worker() {
    let (p, d, _r, base) = one_pair(Kind::Prefill, 0, Kind::Decode).await;
    for (body, want) in [
        ("{not json", "the body is not valid JSON"),
        ("[1, 2]", "the body must be a JSON object"),
        ("{\"text\": []}", "`text` is an empty list"),
    ] {
        let r = client()
            .post(format!("{base}/generate"))
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 400);
        let v: Value = r.json_text().await;
        assert!(
            v["error"]["message"].as_str().unwrap().starts_with(want),
            "{v}"
        );
    }
    assert!(p.bodies().is_empty() && d.bodies().is_empty());
}

/// The `kvserve` binary, killed on drop.
struct Binary(Child);
impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn kvserve(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvserve"));
    c.args(args);
    c
}

#[test]
fn the_binary_refuses_bad_flags_with_a_clear_error() {
    for (args, want) in [
        (
            vec!["--pd-disaggregation", "--decode", "http://127.0.0.1:1"],
            "--prefill",
        ),
        (
            vec![
                "--prefill",
                "http://127.0.0.1:1",
                "--decode",
                "http://127.0.0.1:2",
            ],
            "--pd-disaggregation: --prefill and --decode need --pd-disaggregation",
        ),
        (
            vec![
                "--pd-disaggregation",
                "--prefill",
                "127.0.0.1:1",
                "--decode",
                "http://127.0.0.1:2",
            ],
            "--prefill: \"127.0.0.1:1\" is not a URL",
        ),
        (
            vec![
                "--pd-disaggregation",
                "--prefill",
                "http://:80",
                "--decode",
                "http://127.0.0.1:2",
            ],
            "--prefill: \"http://:80\"",
        ),
        (
            vec![
                "--pd-disaggregation",
                "--prefill",
                "http://a:1",
                "x",
                "--decode",
                "http://b:2",
            ],
            "bootstrap port \"x\"",
        ),
        (
            vec![
                "--pd-disaggregation",
                "--prefill",
                "http://a:1",
                "--decode",
                "http://b:2",
                "--policy",
                "kv_events",
                "--prefill-policy",
                "random",
            ],
            "--decode-policy: kv_events: the PD router does not read KV events",
        ),
        (vec![], "--worker-urls: give at least one worker URL"),
        (
            vec!["--worker-urls", "http://a:1", "http://a:1/"],
            "--worker-urls: http://a:1 is given twice",
        ),
        (
            vec!["--worker-urls", "http://a:1", "--cache-threshold", "1.5"],
            "--cache-threshold: 1.5 is not between 0 and 1",
        ),
        (
            vec![
                "--worker-urls",
                "http://a:1",
                "--pd-disaggregation",
                "--prefill",
                "http://b:1",
                "--decode",
                "http://c:1",
            ],
            "--worker-urls: regular workers and --pd-disaggregation exclude each other",
        ),
    ] {
        let mut argv = vec!["router"];
        argv.extend(args);
        let out = kvserve(&argv).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{argv:?}: {err}");
        assert!(err.contains(want), "{argv:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_routes_between_two_prefill_servers() {
    let (p0, p1) = (mock(Kind::Prefill, 1).await, mock(Kind::Prefill, 2).await);
    let d = mock(Kind::Decode, 0).await;
    let (u0, u1, ud) = (p0.url(), p1.url(), d.url());
    let mut child = kvserve(&[
        "router",
        "--pd-disaggregation",
        "--prefill",
        &u0,
        "9100",
        "--prefill",
        &u1,
        "--decode",
        &ud,
        "--port",
        "0",
        "--policy",
        "round_robin",
    ])
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let stderr = child.stderr.take().unwrap();
    let guard = Binary(child);
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stderr).read_line(&mut line).unwrap();
        line
    })
    .await
    .unwrap();
    // "kvserve: PD router on http://127.0.0.1:PORT: prefill …"
    let port: u16 = line
        .split("http://127.0.0.1:")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    let base = format!("http://127.0.0.1:{port}");
    let mut cached = Vec::new();
    for _ in 0..2 {
        let (status, v) = post_json(&format!("{base}/generate"), &json!({"text": "x"})).await;
        assert_eq!(status, 200, "{v}");
        cached.push(v["meta_info"]["cached_tokens"].clone());
    }
    assert_eq!(cached, [json!(1), json!(2)]);
    assert_eq!(p0.bodies()[0].1["bootstrap_port"], json!(9100));
    assert_eq!(p1.bodies()[0].1["bootstrap_port"], json!(8998));
    drop(guard);
}
