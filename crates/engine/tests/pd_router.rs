//! Through `kvserve router --pd-disaggregation` (in process) to a prefill and a decode server:
//! greedy output equals one server's for `/generate` and chat, streamed and not; the prefill's
//! cached-token count reaches the client; 1,000 requests with random client disconnects leave
//! nothing allocated on either side; a router pointed at a dead server answers with an error.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::pd::{assert_nothing_held, pair, router, router_to};
use common::{http, post, sse_data, start};
use kv_pool::rng::SplitMix64;
use serde_json::{json, Value};

/// The generated text of a response: `/generate`'s, a completion's or a chat message's; for a
/// stream, the text of its events put together.
fn text_of(path: &str, stream: bool, raw: &str) -> String {
    if !stream {
        let v: Value = serde_json::from_str(raw).unwrap_or_else(|_| panic!("{raw}"));
        return match path {
            "/generate" => v["text"].as_str().unwrap().to_string(),
            _ => v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_else(|| v["choices"][0]["text"].as_str().unwrap())
                .to_string(),
        };
    }
    let events: Vec<Value> = sse_data(raw)
        .into_iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    match path {
        // SGLang's stream: every event is the whole text so far.
        "/generate" => events.last().unwrap()["text"].as_str().unwrap().to_string(),
        _ => events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
            .collect(),
    }
}

fn through_the_router_matches_one_server(backend: &str) {
    let ids: Vec<u32> = (0..70).map(|i| 400 + (i * 5) % 3000).collect();
    let generate = json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": true}});
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "Tell me about the tides of the sea."}], "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let cases = [("/generate", generate), ("/v1/chat/completions", chat)];
    let single = start(&[]);
    let p = pair(backend, &["--chunked-prefill-size", "32"], &[]);
    let r = router(&p);
    let rport = r.addr.port();
    for (path, body) in &cases {
        for stream in [false, true] {
            let mut b = body.clone();
            b["stream"] = json!(stream);
            let (s1, want) = http(single.port, "POST", path, &b.to_string());
            assert_eq!(s1, 200, "{want}");
            let (s2, got) = http(rport, "POST", path, &b.to_string());
            assert_eq!(s2, 200, "{got}");
            assert_eq!(
                text_of(path, stream, &got),
                text_of(path, stream, &want),
                "{path} stream={stream} over {backend}"
            );
        }
    }
    // The same prompt again: the prefill's cache hit is what the client is told.
    let (_, again) = post(rport, "/generate", cases[0].1.clone());
    assert!(
        again["meta_info"]["cached_tokens"].as_u64().unwrap() >= 64,
        "{again}"
    );
    assert_nothing_held(&p);
}

#[test]
fn generate_and_chat_through_the_router_match_one_server_over_tcp() {
    through_the_router_matches_one_server("tcp");
}

#[test]
fn generate_and_chat_through_the_router_match_one_server_over_shm() {
    through_the_router_matches_one_server("shm");
}

/// A request whose client goes away at a random moment (before or after the status line).
fn disconnecting_request(port: u16, body: &str, rng: &mut SplitMix64) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let wait = rng.below(30) as u64;
    if wait > 0 {
        std::thread::sleep(Duration::from_millis(wait));
        s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
        let mut buf = [0u8; 64];
        let _ = s.read(&mut buf);
    }
}

#[test]
fn a_thousand_requests_with_random_disconnects_leak_nothing() {
    let p = pair("tcp", &["--chunked-prefill-size", "64"], &[]);
    let r = router(&p);
    let rport = r.addr.port();
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            std::thread::spawn(move || {
                let mut rng = SplitMix64::new(t + 1);
                let mut ok = 0;
                for i in 0..125u64 {
                    // A few shared prefixes, so the caches on both sides hit and evict.
                    let prefix = rng.below(4) as u32;
                    let len = 20 + rng.below(60) as u32;
                    let ids: Vec<u32> = (0..len)
                        .map(|k| if k < 16 { 1000 + prefix * 16 + k } else { 2000 + (k * 31 + i as u32) % 900 })
                        .collect();
                    let stream = rng.below(2) == 0;
                    let body = json!({"input_ids": ids, "stream": stream, "sampling_params": {"max_new_tokens": 1 + rng.below(8), "temperature": 0, "ignore_eos": true}}).to_string();
                    if rng.below(4) == 0 {
                        disconnecting_request(rport, &body, &mut rng);
                    } else {
                        let (status, text) = http(rport, "POST", "/generate", &body);
                        assert_eq!(status, 200, "{text}");
                        ok += 1;
                    }
                }
                ok
            })
        })
        .collect();
    let ok: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(ok > 600, "{ok} of 1000 completed");
    assert_nothing_held(&p);
}

#[test]
fn a_router_pointed_at_a_dead_server_answers_with_an_error() {
    let p = pair("tcp", &[], &[]);
    // A port nothing listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let r = router_to(&p, &dead_url);
    let started = Instant::now();
    let (status, v) = post(
        r.addr.port(),
        "/generate",
        json!({"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3}}),
    );
    assert_eq!(status, 502, "{v}");
    assert!(v.to_string().contains(&dead_url), "{v}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // The prefill side's half of the pair was dropped with the router's request.
    assert_nothing_held(&p);
}
