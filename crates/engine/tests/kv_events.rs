//! `serve --kv-events-config`: the prefix cache's KV events read by a real subscriber (pyzmq +
//! msgpack, `tests/kv_events_subscriber.py`) that rebuilds the server's cache from them, live
//! and by replay; bad configs exit with code 2 naming the flag.
//!
//! The subscriber test skips with a printed reason when Python, pyzmq or msgpack is missing,
//! unless `KVSERVE_REQUIRE_PYZMQ=1` (CI installs them and sets it).

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::Duration;

use common::{get, post, start};
use radix_cache::events::{chain_digests, digest_to_block_id};
use serde_json::{json, Value};

const PAGE: usize = 16;

/// The subscriber script, killed on drop (also when the test fails).
struct Subscriber {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

/// What the subscriber rebuilt.
#[derive(Debug)]
struct State {
    blocks: BTreeSet<i64>,
    live_seqs: Vec<u64>,
    replayed_seqs: Vec<u64>,
}

impl Subscriber {
    fn spawn(kv: &Value, late: bool) -> Subscriber {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/kv_events_subscriber.py");
        let mut args = vec![
            script.to_string(),
            kv["endpoint"].as_str().unwrap().to_string(),
            kv["replay_endpoint"].as_str().unwrap().to_string(),
            kv["topic"].as_str().unwrap().to_string(),
        ];
        if late {
            args.push("--late".into());
        }
        let mut child = Command::new("python3")
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let s = Subscriber {
            child,
            stdin,
            lines,
        };
        assert!(s.answer()["ready"] == true);
        s
    }

    fn answer(&self) -> Value {
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(90))
            .expect("the subscriber answers");
        serde_json::from_str(&line).unwrap()
    }

    /// Waits until the subscriber applied batches `0..n`; its state then.
    fn sync(&mut self, n: u64) -> State {
        writeln!(self.stdin, "sync {n}").unwrap();
        let a = self.answer();
        assert_eq!(a["errors"], json!([]), "the subscriber's decoding errors");
        assert_eq!(a["applied"], n, "batches applied: {a}");
        let nums = |k: &str| -> Vec<u64> {
            a[k].as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect()
        };
        State {
            blocks: a["blocks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_i64().unwrap())
                .collect(),
            live_seqs: nums("live_seqs"),
            replayed_seqs: nums("replayed_seqs"),
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The publisher's state in `/get_server_info`.
fn kv_info(port: u16) -> Value {
    get(port, "/get_server_info")["engine"]["kv_events"].clone()
}

/// Batches published so far (every change before this call is in one of them).
fn published(port: u16) -> u64 {
    kv_info(port)["batches_published"].as_u64().unwrap()
}

/// Tokens the server's cache holds.
fn cached_tokens(port: u16) -> usize {
    let e = &get(port, "/get_server_info")["engine"];
    (e["evictable_tokens"].as_u64().unwrap() + e["protected_tokens"].as_u64().unwrap()) as usize
}

/// SGLang's block ids of the whole pages of `tokens` (default namespace).
fn block_ids(tokens: &[u32]) -> Vec<i64> {
    chain_digests(None, tokens, PAGE)
        .iter()
        .map(digest_to_block_id)
        .collect()
}

/// Runs `prompt` greedily; returns (output ids, cached tokens).
fn generate(port: u16, prompt: &[u32], max_new_tokens: usize) -> (Vec<u32>, usize) {
    let (status, r) = post(
        port,
        "/generate",
        json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": true}}),
    );
    assert_eq!(status, 200, "{r}");
    let out = r["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    (
        out,
        r["meta_info"]["cached_tokens"].as_u64().unwrap() as usize,
    )
}

/// The subscriber's blocks are the server's cache: as many tokens as the tree holds, every
/// block a page of a sequence the server ran, and along every sequence a prefix of its pages
/// (a tree holds a page only with the pages before it).
fn assert_mirrors_the_tree(port: u16, blocks: &BTreeSet<i64>, sequences: &[Vec<u32>]) {
    assert_eq!(blocks.len() * PAGE, cached_tokens(port), "{blocks:?}");
    let mut known = BTreeSet::new();
    for seq in sequences {
        let ids = block_ids(seq);
        let held = ids.iter().take_while(|b| blocks.contains(b)).count();
        assert!(
            ids[held..].iter().all(|b| !blocks.contains(b)),
            "a page cached without the pages before it"
        );
        known.extend(ids);
    }
    assert!(blocks.is_subset(&known), "blocks no request produced");
}

#[test]
fn a_subscriber_rebuilds_the_cache_from_the_events_live_and_by_replay() {
    if !common::python_can_import("zmq, msgpack", "KVSERVE_REQUIRE_PYZMQ") {
        return;
    }
    // 32 pages: the workload's 48 distinct pages do not fit, so pages are evicted.
    let srv = start(&[
        "--max-total-tokens",
        "512",
        "--kv-events-config",
        r#"{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0",
            "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv-events"}"#,
    ]);
    let kv = kv_info(srv.port);
    assert_eq!(kv["publisher"], "zmq");
    assert_ne!(
        kv["endpoint"], "tcp://127.0.0.1:0",
        "the bound port is shown"
    );
    let mut live = Subscriber::spawn(&kv, false);
    // Let the subscription reach the PUB socket (a batch missed before it would be replayed).
    std::thread::sleep(Duration::from_millis(300));

    // Six groups of two requests sharing a 64-token prefix, 96-token prompts.
    let mut sequences = Vec::new();
    let mut prompts = Vec::new();
    for g in 0..6u32 {
        for r in 0..2u32 {
            let prompt: Vec<u32> = (0..96u32)
                .map(|i| {
                    if i < 64 {
                        1000 + g * 100 + i
                    } else {
                        20_000 + g * 1000 + r * 100 + i
                    }
                })
                .collect();
            let (out, _) = generate(srv.port, &prompt, 8);
            sequences.push([prompt.clone(), out].concat());
            prompts.push(prompt);
        }
    }
    let state = live.sync(published(srv.port));
    assert!(!state.blocks.is_empty());
    assert_mirrors_the_tree(srv.port, &state.blocks, &sequences);
    let evictions = sequences
        .iter()
        .flat_map(|s| block_ids(s))
        .collect::<BTreeSet<_>>()
        .len()
        - state.blocks.len();
    assert!(evictions > 0, "the workload evicted nothing");

    // The subscriber predicts each sequence's cache hit exactly, newest first: whole hits,
    // shared prefixes only, and misses. A probe is the prompt and its first output token, so
    // its match (all but the last token, in whole pages) reaches every page the sequence
    // could have cached.
    let mut blocks = state.blocks;
    let mut hits = BTreeSet::new();
    for (prompt, seq) in prompts.iter().zip(sequences.clone()).rev() {
        let probe = &seq[..prompt.len() + 1];
        let hit = block_ids(&probe[..probe.len() - 1])
            .iter()
            .take_while(|b| blocks.contains(b))
            .count();
        let (out, cached) = generate(srv.port, probe, 1);
        assert_eq!(cached, hit * PAGE, "predicted from the events");
        hits.insert(hit);
        sequences.push([probe.to_vec(), out].concat());
        blocks = live.sync(published(srv.port)).blocks;
        assert_mirrors_the_tree(srv.port, &blocks, &sequences);
    }

    assert!(hits.len() >= 3 && hits.contains(&0), "hits {hits:?}");

    // A flush clears everything; then a cache without evictions is known exactly: each
    // request's prompt and output but the last token, in whole pages.
    let (status, r) = post(srv.port, "/flush_cache", json!({}));
    assert_eq!(status, 200, "{r}");
    assert!(live.sync(published(srv.port)).blocks.is_empty());
    let mut expected = BTreeSet::new();
    for k in 0..2u32 {
        let prompt: Vec<u32> = (0..40).map(|i| 30_000 + k * 500 + i).collect();
        let (out, _) = generate(srv.port, &prompt, 4);
        let committed = [prompt, out].concat();
        expected.extend(block_ids(&committed[..committed.len() - 1]));
    }
    let n = published(srv.port);
    let state = live.sync(n);
    assert_eq!(state.blocks, expected);
    assert_eq!(state.blocks.len() * PAGE, cached_tokens(srv.port));
    // The live stream has no gap (batches missed before the subscription took effect, if
    // any, came by replay).
    assert!(
        state.live_seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "a gap in {:?}",
        state.live_seqs
    );
    let mut all: Vec<u64> = state
        .live_seqs
        .iter()
        .chain(&state.replayed_seqs)
        .copied()
        .collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all, (0..n).collect::<Vec<_>>());

    // A subscriber that joins now rebuilds the same cache from the replay buffer alone.
    let mut late = Subscriber::spawn(&kv, true);
    let replayed = late.sync(n);
    assert_eq!(replayed.blocks, expected);
    assert_eq!(replayed.replayed_seqs, (0..n).collect::<Vec<_>>());

    let kv = kv_info(srv.port);
    assert_eq!(kv["batches_published"], n);
    assert_eq!(kv["batches_sent"], n);
    assert_eq!(kv["batches_dropped"], 0);
    assert!(kv["replay_requests"].as_u64().unwrap() >= 1);
}

/// The replay buffer is bounded by `buffer_steps`: a replay from 0 after more batches than
/// that sends only the last `buffer_steps`, in order (the router's subscriber then reports
/// the rest as missed).
#[test]
fn the_replay_buffer_keeps_the_last_buffer_steps_batches() {
    if !common::python_can_import("zmq, msgpack", "KVSERVE_REQUIRE_PYZMQ") {
        return;
    }
    let srv = start(&[
        "--kv-events-config",
        r#"{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0",
            "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv", "buffer_steps": 3}"#,
    ]);
    for g in 0..6u32 {
        let ids: Vec<u32> = (0..48).map(|i| 100 * g + i).collect();
        let (status, v) = post(
            srv.port,
            "/generate",
            json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}),
        );
        assert_eq!(status, 200, "{v}");
    }
    let n = published(srv.port);
    assert!(n > 3, "{n} batches");
    // Every batch through the publisher thread (and so in its buffer).
    for _ in 0..500 {
        if kv_info(srv.port)["batches_sent"] == n {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let kv = kv_info(srv.port);
    assert_eq!(kv["batches_sent"], n);
    let mut sub = Subscriber::spawn(&kv, false);
    writeln!(sub.stdin, "replay 0").unwrap();
    let seqs = sub.answer()["seqs"].clone();
    assert_eq!(seqs, json!([n - 3, n - 2, n - 1]));
}

/// A bad `--kv-events-config` stops the binary with exit code 2, naming the flag and the key.
#[test]
fn a_bad_kv_events_config_exits_2_naming_the_flag() {
    for (config, want) in [
        (
            r#"{"publisher": "zmq", "endpont": "tcp://*:5557"}"#,
            "unknown field `endpont`",
        ),
        (r#"{"publisher": "kafka"}"#, "publisher: unknown variant"),
        (
            r#"{"publisher": "zmq", "endpoint": "ipc:///tmp/kv"}"#,
            "only tcp",
        ),
        (
            r#"{"publisher": "zmq", "max_queue_size": 0}"#,
            "max_queue_size",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvserve"))
            .args(["serve", "--port", "0", "--kv-events-config", config])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{config}: {stderr}");
        assert!(stderr.contains("--kv-events-config"), "{stderr}");
        assert!(stderr.contains(want), "{config}: {stderr}");
    }
}

/// An endpoint already bound by someone else is a clean start-up error, not a panic.
#[test]
fn an_endpoint_in_use_is_an_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let config = format!(r#"{{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:{port}"}}"#);
    let out = Command::new(env!("CARGO_BIN_EXE_kvserve"))
        .args(["serve", "--port", "0", "--kv-events-config", &config])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--kv-events-config") && stderr.contains("cannot bind"),
        "{stderr}"
    );
}
