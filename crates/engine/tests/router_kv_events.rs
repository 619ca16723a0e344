//! `kvserve router --policy kv_events` over real `kvserve serve` workers on loopback, each
//! publishing its KV events (`--kv-events-config`): the router's index follows what each
//! worker really caches (pages stored, a flushed cache emptied), a prompt sharing a cached
//! prefix goes to the worker that holds it and is served from its cache, a new prefix goes to
//! the worker holding the fewest pages, and a worker added at run time with its endpoint is
//! followed.

mod common;

use std::time::{Duration, Instant};

use common::{get, post, start, Server};
use engine::router::{spawn, BackgroundRouter, EventSource, PolicyKind, RouterConfig};
use engine::setup::source::ModelSource;
use serde_json::{json, Value};

/// A worker publishing its KV events, with a replay socket; its event endpoints.
fn worker() -> (Server, EventSource) {
    let srv = start(&[
        "--kv-events-config",
        r#"{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0",
            "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv"}"#,
    ]);
    let kv = &get(srv.port, "/get_server_info")["engine"]["kv_events"];
    let source = EventSource {
        endpoint: kv["endpoint"].as_str().unwrap().to_string(),
        replay: Some(kv["replay_endpoint"].as_str().unwrap().to_string()),
    };
    (srv, source)
}

/// The router's view: pages held per worker.
fn pages(router: u16) -> Vec<u64> {
    get(router, "/get_server_info")["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["kv_pages"].as_u64().unwrap())
        .collect()
}

/// Waits until the router's index shows `want` (the events travel asynchronously).
fn wait_pages(router: u16, want: impl Fn(&[u64]) -> bool) -> Vec<u64> {
    let start = Instant::now();
    loop {
        let p = pages(router);
        if want(&p) {
            return p;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "index stuck at {p:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `ids` through the router; its cached tokens.
fn generate(router: u16, ids: &[u32]) -> u64 {
    let (status, v) = post(
        router,
        "/generate",
        json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}),
    );
    assert_eq!(status, 200, "{v}");
    v["meta_info"]["cached_tokens"].as_u64().unwrap()
}

fn sent(router: u16) -> Vec<u64> {
    let (_, text) = common::http(router, "GET", "/metrics", "");
    text.lines()
        .filter(|l| l.starts_with("kvserve_router:worker_requests_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect()
}

/// Three workers behind a `kv_events` router (with `tokenizer`, its `--tokenizer-path`): the
/// workers, their URLs, the router (stopped on drop) and its port.
fn cluster(
    tokenizer: Option<ModelSource>,
) -> (
    Vec<(Server, EventSource)>,
    Vec<String>,
    BackgroundRouter,
    u16,
) {
    let workers: Vec<(Server, EventSource)> = (0..3).map(|_| worker()).collect();
    let urls: Vec<String> = workers
        .iter()
        .map(|(s, _)| format!("http://127.0.0.1:{}", s.port))
        .collect();
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let mut cfg = RouterConfig::regular(&refs, PolicyKind::KvEvents).unwrap();
    cfg.kv_events = workers.iter().map(|(_, e)| e.clone()).collect();
    cfg.kv_events_topic = "kv".into();
    cfg.tokenizer = tokenizer;
    let r = spawn(cfg, "127.0.0.1:0", 2).unwrap();
    let rp = r.addr.port();
    // Let the subscriptions reach the PUB sockets.
    std::thread::sleep(Duration::from_millis(500));
    (workers, urls, r, rp)
}

#[test]
fn requests_follow_the_pages_each_worker_really_holds() {
    let (workers, urls, _router, rp) = cluster(None);

    let a: Vec<u32> = (0..96).map(|i| 500 + i).collect();
    assert_eq!(generate(rp, &a), 0);
    let after_a = wait_pages(rp, |p| p.iter().sum::<u64>() > 0);
    let holder = after_a.iter().position(|&n| n > 0).unwrap();
    let info = get(rp, "/get_server_info");
    let page = info["router"]["kv_index"]["block_size"].as_u64().unwrap();
    assert!(after_a[holder] >= 96 / page - 1, "{after_a:?}");

    // Shares A's first 64 tokens: to A's holder, served from its cache.
    let mut b = a[..64].to_vec();
    b.extend(2000..2032);
    let before = sent(rp);
    assert!(
        generate(rp, &b) >= 64 - page,
        "served from the holder's cache"
    );
    let after = sent(rp);
    assert_eq!(after[holder], before[holder] + 1, "{before:?} → {after:?}");

    // A new prefix goes to a worker holding nothing.
    let c: Vec<u32> = (0..96).map(|i| 3000 + i).collect();
    generate(rp, &c);
    let p = wait_pages(rp, |p| p.iter().filter(|&&n| n > 0).count() == 2);
    let other = (0..3).find(|&i| i != holder && p[i] > 0).unwrap();
    assert!(generate(rp, &c) > 0, "C again, from cache");
    assert_eq!(sent(rp)[other], 2, "C twice on the same worker");

    // A flushed worker's pages leave the index (AllBlocksCleared).
    let holder_port = workers[holder].0.port;
    let (status, _) = common::http(holder_port, "POST", "/flush_cache", "");
    assert_eq!(status, 200);
    wait_pages(rp, |p| p[holder] == 0);
    assert_eq!(
        get(rp, "/get_server_info")["router"]["kv_index"]["unplaced_pages"],
        json!(0)
    );

    // Run time: a worker added with its event endpoints is followed, what it cached before
    // included (replayed when its next batch shows the gap); removed ones are gone from the
    // index at once.
    let (late, late_events) = worker();
    let late_url = format!("http://127.0.0.1:{}", late.port);
    let d: Vec<u32> = (0..96).map(|i| 9000 + i).collect();
    let (status, v) = post(
        late.port,
        "/generate",
        json!({"input_ids": d, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}),
    );
    assert_eq!(status, 200, "{v}");
    // D's events leave the late worker before the router subscribes, so they are missed.
    let start = Instant::now();
    loop {
        let kv = &get(late.port, "/get_server_info")["engine"]["kv_events"];
        let published = kv["batches_published"].as_u64().unwrap();
        if published > 0 && kv["batches_sent"].as_u64().unwrap() == published {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{kv}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, v) = post(rp, &format!("/add_worker?url={late_url}"), json!({}));
    assert_eq!(status, 400, "kv_events needs the endpoint: {v}");
    let add = format!(
        "/add_worker?url={late_url}&kv_events={}&kv_events_replay={}",
        late_events.endpoint,
        late_events.replay.as_deref().unwrap()
    );
    let (status, v) = post(rp, &add, json!({}));
    assert_eq!(status, 200, "{v}");
    for u in &urls {
        let (status, v) = post(rp, &format!("/remove_worker?url={u}"), json!({}));
        assert_eq!(status, 200, "{v}");
    }
    assert_eq!(pages(rp), [0], "only the new worker, holding nothing yet");
    std::thread::sleep(Duration::from_millis(500));
    // E holds at most 2 pages; D's pages (at least 96 / page − 1) come only by replay.
    let e: Vec<u32> = (0..32).map(|i| 7000 + i).collect();
    generate(rp, &e);
    wait_pages(rp, |p| p[0] >= 96 / page);
    assert_eq!(
        get(rp, "/get_server_info")["router"]["kv_index"]["unplaced_pages"],
        json!(0)
    );
    let _: Value = get(rp, "/list_workers");
}

/// Text prompts (`/generate` text, a completion's prompt, chat messages) through a router that
/// has the workers' tokenizer (`--tokenizer-path tiny`): each goes to the worker that caches
/// its prefix, as token ids do.
#[test]
fn text_prompts_follow_the_pages_with_the_workers_tokenizer() {
    let (_workers, _urls, _router, rp) = cluster(Some(ModelSource::Tiny));

    let long = |tag: &str| {
        (0..60)
            .map(|i| format!("{tag}{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let a = long("alpha");
    let (status, v) = post(
        rp,
        "/generate",
        json!({"text": a, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}),
    );
    assert_eq!(status, 200, "{v}");
    let held = wait_pages(rp, |p| p.iter().sum::<u64>() > 0);
    let holder = held.iter().position(|&n| n > 0).unwrap();

    // A completion whose prompt extends A's text: to A's holder, from its cache.
    let before = sent(rp);
    let (status, v) = post(
        rp,
        "/v1/completions",
        json!({"model": "tiny", "prompt": format!("{a} and then some more words"),
               "max_tokens": 1, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{v}"
    );
    let after = sent(rp);
    assert_eq!(after[holder], before[holder] + 1, "{before:?} → {after:?}");

    // A chat: a new prefix (to a worker holding nothing), then the conversation's next turn,
    // which renders to the first turn's tokens and more: to the same worker, from its cache.
    let chat = |messages: Value| {
        let (status, v) = post(
            rp,
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0}),
        );
        assert_eq!(status, 200, "{v}");
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let first = json!([{"role": "system", "content": long("beta")},
        {"role": "user", "content": "hello"}]);
    chat(first.clone());
    let p = wait_pages(rp, |p| p.iter().filter(|&&n| n > 0).count() == 2);
    let talker = (0..3).find(|&i| i != holder && p[i] > 0).unwrap();
    let before = sent(rp);
    let mut next = first.as_array().unwrap().clone();
    next.push(json!({"role": "assistant", "content": "hi"}));
    next.push(json!({"role": "user", "content": "tell me more"}));
    assert!(
        chat(Value::Array(next)) > 0,
        "the next turn reuses the first"
    );
    let after = sent(rp);
    assert_eq!(after[talker], before[talker] + 1, "{before:?} → {after:?}");
}
