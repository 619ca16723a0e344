//! The `kvserve` binary: output formats, a snapshot of the table, and bad input (exit code 2,
//! a message naming the line or flag, no panic).

use std::path::PathBuf;
use std::process::{Command, Output};

fn kvserve(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvserve"))
        .args(args)
        .output()
        .expect("run kvserve")
}

fn tmp(name: &str, contents: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

/// Runs `args` with `--check --no-timings --quiet` (a reproducible table) and returns stdout,
/// asserting success.
fn checked_table(args: &[&str]) -> String {
    let mut args = args.to_vec();
    args.extend(["--check", "--no-timings", "--quiet"]);
    let o = kvserve(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
}

/// Asserts a clean failure: exit code 2, every `needles` in stderr, no panic.
fn assert_fails(args: &[&str], needles: &[&str]) {
    let o = kvserve(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: expected {n:?} in {err}");
    }
}

#[test]
fn table_snapshot_of_a_small_gsp_run() {
    let o = kvserve(&[
        "cache-sim",
        "--workload",
        "gsp",
        "--gsp-num-groups",
        "4",
        "--gsp-prompts-per-group",
        "4",
        "--gsp-system-prompt-len",
        "256",
        "--gsp-question-len",
        "32",
        "--page-size",
        "16",
        "--policy",
        "lru,mru,slru,belady",
        "--capacity-tokens",
        "300,576,1024,inf",
        "--check",
        "--no-timings",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o), "", "--quiet prints nothing on stderr");
    insta::assert_snapshot!(stdout(&o));
}

#[test]
fn lineage_ttl_table_on_a_mooncake_slice() {
    // The first 400 requests of the Mooncake conversation trace (tests/data/README.md): the
    // policy's hit rate and share of the LRU → Belady gap, pinned.
    let trace = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/mooncake_conversation_head400.jsonl");
    let table = checked_table(&[
        "cache-sim",
        "--trace",
        trace.to_str().unwrap(),
        "--page-size",
        "512",
        "--capacity-tokens",
        "262144,524288,1048576",
        "--policy",
        "lru,lineage-ttl,belady",
    ]);
    insta::assert_snapshot!(table);
}

#[test]
fn json_lines_carry_every_field() {
    let o = kvserve(&[
        "cache-sim",
        "--workload",
        "multiturn",
        "--mt-sessions",
        "3",
        "--mt-turns",
        "3",
        "--mt-input-len",
        "40",
        "--mt-output-len",
        "8",
        "--policy",
        "lru,cost-aware",
        "--capacity-tokens",
        "100,inf",
        "--format",
        "json",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    let inf = &lines[1];
    assert_eq!(inf["policy"], "lru");
    assert_eq!(inf["page_size"], 1);
    assert_eq!(inf["requests"], 9);
    assert_eq!(inf["skipped_requests"], 0);
    assert_eq!(inf["evicted_tokens"], 0);
    // Turn 1 reuses 40 tokens, turn 2 reuses 88, per session.
    assert_eq!(inf["cached_tokens"], 3 * (40 + 88));
    assert_eq!(inf["prompt_tokens"], 3 * (40 + 88 + 136));
    for field in ["capacity_tokens", "hit_rate", "seconds", "tokens_per_s"] {
        assert!(inf[field].is_number(), "{field}");
    }
    assert_eq!(lines[0]["capacity_tokens"], 100);
    assert_eq!(lines[2]["policy"], "cost-aware");
}

#[test]
fn mooncake_trace_through_the_binary() {
    let trace = tmp(
        "cli_trace.jsonl",
        r#"{"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]}
{"timestamp": 10, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 4]}
{"timestamp": 20, "input_length": 600, "output_length": 10, "hash_ids": [1, 5]}
"#,
    );
    let plot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli_plot.png");
    let _ = std::fs::remove_file(&plot);
    let o = kvserve(&[
        "cache-sim",
        "--trace",
        trace.to_str().unwrap(),
        "--page-size",
        "512",
        "--capacity-tokens",
        "1000,inf",
        "--policy",
        "all",
        "--format",
        "json",
        "--plot",
        plot.to_str().unwrap(),
        "--check",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("capacity 1000 rounded up to 1024"), "{err}");
    let lines: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 14);
    let policies: Vec<&str> = lines
        .iter()
        .step_by(2)
        .map(|l| l["policy"].as_str().unwrap())
        .collect();
    assert_eq!(
        policies,
        ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]
    );
    for l in &lines {
        // 1200 and 1100 tokens need 3 pages: skipped at 1,024 tokens; the 600-token prompt fits.
        if l["capacity_tokens"] == 1024 {
            assert_eq!(
                (l["skipped_requests"].as_u64(), l["cached_tokens"].as_u64()),
                (Some(2), Some(0))
            );
        } else {
            assert_eq!(l["cached_tokens"], 1024 + 512);
        }
    }
    assert!(std::fs::read(&plot).unwrap().starts_with(b"\x89PNG"));
}

#[test]
fn bad_input_exits_with_code_2_naming_the_problem() {
    let trace = tmp(
        "cli_bad.jsonl",
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
         {\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
         {\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1, 2]}\n",
    );
    let t = trace.to_str().unwrap();
    assert_fails(
        &["cache-sim", "--trace", t],
        &["cli_bad.jsonl line 3", "hash_ids"],
    );
    assert_fails(
        &["cache-sim", "--trace", "/nonexistent/trace.jsonl"],
        &["/nonexistent/trace.jsonl"],
    );
    assert_fails(
        &["cache-sim", "--policy", "lru,clock"],
        &["--policy", "clock"],
    );
    assert_fails(
        &["cache-sim", "--capacity-tokens", "1024,0"],
        &["--capacity-tokens", "0 tokens"],
    );
    assert_fails(
        &["cache-sim", "--capacity-tokens", "12x"],
        &["--capacity-tokens", "12x"],
    );
    assert_fails(
        &["cache-sim", "--capacity-fraction=-1"],
        &["--capacity-fraction", "positive"],
    );
    assert_fails(
        &["cache-sim", "--capacity-fraction", "1/0"],
        &["--capacity-fraction", "positive"],
    );
    assert_fails(&["cache-sim", "--page-size", "0"], &["--page-size"]);
    assert_fails(
        &["cache-sim", "--gsp-num-groups", "many"],
        &["--gsp-num-groups"],
    );
    assert_fails(
        &["cache-sim", "--gsp-num-groups", "0"],
        &["--gsp-num-groups"],
    );
    assert_fails(&["cache-sim", "--format", "xml"], &["--format"]);
    assert_fails(
        &["cache-sim", "--trace", t, "--workload", "gsp"],
        &["--workload"],
    );
    assert_fails(&["frobnicate"], &["frobnicate"]);
}

#[test]
fn default_capacities_sweep_up_to_never_evicting() {
    // 2 groups × 2 prompts of 2,048 + 128 tokens: 2 × 2,048 + 4 × 128 = 4,608 unique tokens
    // at P = 1. 1/16, 1/8 and 1/4 of that are below the longest prompt (2,176) and raised to
    // it (then deduplicated); 1/2 is 2,304; `inf` is 4,608 + 2,176.
    let o = kvserve(&[
        "cache-sim",
        "--gsp-num-groups",
        "2",
        "--gsp-prompts-per-group",
        "2",
        "--format",
        "json",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let capacities: Vec<u64> = lines
        .iter()
        .map(|l| l["capacity_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(capacities, [2176, 2304, 4608 + 2176]);
    let last = lines.last().unwrap();
    assert_eq!(last["policy"], "lru");
    assert_eq!(last["cached_tokens"], 2 * 2048);
    assert_eq!(last["evicted_tokens"], 0);
}

const SMALL_GSP: [&str; 14] = [
    "--workload",
    "gsp",
    "--gsp-num-groups",
    "4",
    "--gsp-prompts-per-group",
    "4",
    "--gsp-system-prompt-len",
    "512",
    "--gsp-question-len",
    "32",
    "--gsp-output-len",
    "32",
    "--page-size",
    "16",
];

#[test]
fn sim_table_snapshot() {
    let mut args = vec!["sim"];
    args.extend(SMALL_GSP);
    args.extend([
        "--request-rate",
        "8",
        "--schedule-policy",
        "fcfs,lpm",
        "--radix-eviction-policy",
        "lru,lfu",
        "--max-total-tokens",
        "1024,4096",
    ]);
    insta::assert_snapshot!(checked_table(&args));
}

/// `sim --allocator all`: every allocator policy on the same workload, with the contiguity
/// table (runs per request, PD transfer blocks, page-table reads, free-page fragmentation).
#[test]
fn sim_allocator_contiguity_snapshot() {
    let mut args = vec!["sim"];
    args.extend(SMALL_GSP);
    args.extend([
        "--request-rate",
        "8",
        "--max-total-tokens",
        "1024,4096",
        "--allocator",
        "all",
    ]);
    insta::assert_snapshot!(checked_table(&args));
    assert_fails(&["sim", "--allocator", "buddy"], &["--allocator", "buddy"]);
    assert_fails(&["sim", "--contiguity-plot", "x.png"], &["--allocator"]);
}

#[test]
fn sim_json_lines_carry_every_field_and_no_cache_reuses_nothing() {
    let mut args = vec!["sim"];
    args.extend(SMALL_GSP);
    args.extend([
        "--disable-radix-cache",
        "--format",
        "json",
        "--quiet",
        "--model",
        "llama-3-70b",
        "--tp",
        "4",
        "--accelerator",
        "a100",
    ]);
    let o = kvserve(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let line = stdout(&o);
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    for key in [
        "schedule_policy",
        "eviction_policy",
        "capacity_tokens",
        "requests",
        "hit_rate",
        "prefill_tokens",
        "output_tokens_per_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "itl_p50_s",
        "itl_p99_s",
        "retractions",
    ] {
        assert!(v.get(key).is_some(), "missing {key} in {line}");
    }
    assert_eq!(v["eviction_policy"], "disabled");
    assert_eq!(v["hit_rate"], 0.0);
    assert_eq!(v["requests"], 16);
}

/// `sim` with the HiCache flags: a pool too small for the four system prompts, a host tier
/// behind it and an L3 store behind that; the table adds the prompt tokens per tier, and the
/// flags are checked as `serve` checks them.
#[test]
fn sim_tiers_table_snapshot() {
    let mut args = vec!["sim"];
    args.extend(SMALL_GSP);
    args.extend([
        "--request-rate",
        "2",
        "--max-total-tokens",
        "1024,2048",
        "--enable-hierarchical-cache",
        "--hicache-write-policy",
        "write_back",
        "--hicache-storage-backend",
        "file",
    ]);
    insta::assert_snapshot!(checked_table(&args));
    assert_fails(
        &["sim", "--storage-bandwidth", "5"],
        &["--storage-bandwidth", "--enable-hierarchical-cache"],
    );
    assert_fails(
        &[
            "sim",
            "--enable-hierarchical-cache",
            "--disable-radix-cache",
        ],
        &["--disable-radix-cache"],
    );
    assert_fails(
        &[
            "sim",
            "--enable-hierarchical-cache",
            "--hicache-write-policy",
            "sometimes",
        ],
        &["--hicache-write-policy", "sometimes"],
    );
}

/// `cache-sim` with the HiCache flags: hit rate per tier for each policy and capacity.
#[test]
fn cache_sim_tiers_table_snapshot() {
    let mut args = vec!["cache-sim"];
    args.extend(SMALL_GSP);
    args.extend([
        "--policy",
        "lru,belady",
        "--capacity-tokens",
        "576,1024",
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "2",
        "--hicache-storage-backend",
        "file",
    ]);
    insta::assert_snapshot!(checked_table(&args));
    assert_fails(
        &[
            "cache-sim",
            "--enable-hierarchical-cache",
            "--hicache-size",
            "4",
        ],
        &["--hicache-size", "--hicache-ratio"],
    );
}

#[test]
fn sim_bad_input_exits_with_code_2() {
    assert_fails(&["sim", "--model", "gpt-9"], &["--model", "gpt-9"]);
    assert_fails(&["sim", "--accelerator", "tpu"], &["--accelerator"]);
    assert_fails(
        &["sim", "--schedule-policy", "fastest"],
        &["--schedule-policy", "fastest"],
    );
    assert_fails(&["sim", "--radix-eviction-policy", "lru9"], &["lru9"]);
    assert_fails(
        &["sim", "--model", "llama-3-70b", "--quiet"],
        &["--mem-fraction-static", "weights"],
    );
    assert_fails(
        &["sim", "--mem-fraction-static", "1.5"],
        &["--mem-fraction-static"],
    );
    assert_fails(&["sim", "--request-rate", "-3"], &["--request-rate"]);
    assert_fails(&["sim", "--tp", "0"], &["--tp"]);
}

#[test]
fn bench_runs_the_tiny_model_with_and_without_the_cache() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let json = dir.join("bench.json");
    let png = dir.join("bench.png");
    let o = kvserve(&[
        "bench",
        "--gsp-num-groups",
        "2",
        "--gsp-prompts-per-group",
        "3",
        "--gsp-system-prompt-len",
        "96",
        "--gsp-question-len",
        "16",
        "--gsp-output-len",
        "4",
        "--request-rate",
        "100",
        "--compare-no-cache",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        png.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("[radix] 6 requests (0 aborted)"), "{text}");
    assert!(text.contains("[no-cache] 6 requests (0 aborted)"), "{text}");
    assert!(text.contains("radix cache vs none"), "{text}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v[0]["cache"], "radix");
    assert_eq!(v[1]["cached_tokens"], 0);
    assert!(v[0]["cached_tokens"].as_u64().unwrap() > 0);
    assert_eq!(v[0]["output_tokens"], 24);
    assert!(std::fs::metadata(&png).unwrap().len() > 1000);
}

#[test]
fn bench_bad_input_exits_with_code_2() {
    assert_fails(
        &["bench", "--backend", "cuda"],
        &["--backend", "not compiled"],
    );
    assert_fails(
        &["bench", "--backend", "rocm"],
        &["--backend", "not compiled"],
    );
    assert_fails(
        &["bench", "--kv-cache-dtype", "int3"],
        &["--kv-cache-dtype"],
    );
    assert_fails(&["bench", "--request-rate", "fast"], &["--request-rate"]);
    assert_fails(
        &["bench", "--schedule-policy", "nope"],
        &["--schedule-policy"],
    );
    assert_fails(
        &["bench", "--model-path", "/nonexistent/model"],
        &["model", "/nonexistent/model"],
    );
    assert_fails(
        &["bench", "--max-total-tokens", "8"],
        &["--max-total-tokens"],
    );
}

#[test]
fn info_lists_this_build() {
    let o = kvserve(&["info"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    for needle in [
        "backends:           cpu",
        "allocators:         token, paged, best_fit",
        "prefix caches:      radix, chunk",
        "cost-aware",
        "LlamaForCausalLM",
    ] {
        assert!(text.contains(needle), "{needle:?} in {text}");
    }
    let o = kvserve(&["info", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let backends = v["backends"].as_array().unwrap();
    assert_eq!(backends[0]["name"], "cpu");
    assert_eq!(backends[0]["compiled"], true);
    // Every backend listed as compiled is accepted by --backend, every other one refused
    // with the feature that would bring it.
    for b in backends {
        let name = b["name"].as_str().unwrap();
        if b["compiled"] == false {
            let hint = match b["feature"].as_str() {
                Some(feature) => format!("--features {feature}"),
                None => "no feature of this version provides it".to_string(),
            };
            assert_fails(
                &["bench", "--backend", name, "--quiet"],
                &["--backend", "not compiled", &hint],
            );
        }
    }
}

/// `--cuda-graph-max-bs` 0 or above `--max-running-requests` is refused on every backend;
/// `kvserve info` says which decode batch sizes the cuda backend captures, or why none, and
/// which MLA form it takes; an unknown `--cuda-attention-kernel` is refused naming the two
/// kernels.
#[test]
fn cuda_graph_flags_are_checked_and_reported() {
    assert_fails(
        &["bench", "--cuda-graph-max-bs", "0", "--quiet"],
        &["--cuda-graph-max-bs", "at least 1"],
    );
    assert_fails(
        &[
            "bench",
            "--cuda-graph-max-bs",
            "9",
            "--max-running-requests",
            "8",
        ],
        &["--cuda-graph-max-bs", "exceeds --max-running-requests (8)"],
    );
    assert_fails(
        &["info", "--cuda-graph-max-bs", "300"],
        &["--cuda-graph-max-bs", "(256)"],
    );
    assert_fails(
        &["bench", "--cuda-attention-kernel", "flash"],
        &["--cuda-attention-kernel", "chunked", "pipelined"],
    );
    let o = kvserve(&["info", "--disable-cuda-graph"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("cuda graphs:        off (--disable-cuda-graph)"),
        "{}",
        stdout(&o)
    );
    // The MLA form the cuda backend takes, with and without --cuda-mla-tensor-cores.
    let o = kvserve(&["info"]);
    assert!(
        stdout(&o).contains("cuda mla:           the lanes' form (--cuda-mla-tensor-cores"),
        "{}",
        stdout(&o)
    );
    let o = kvserve(&["info", "--cuda-mla-tensor-cores"]);
    assert!(
        stdout(&o).contains("cuda mla:           the tensor-core form (mma.sync)"),
        "{}",
        stdout(&o)
    );
    // And the mixture-of-experts form, with and without --cuda-moe-tensor-cores.
    assert!(
        stdout(&o).contains("cuda moe:           the lanes' form (--cuda-moe-tensor-cores"),
        "{}",
        stdout(&o)
    );
    let o = kvserve(&["info", "--cuda-moe-tensor-cores"]);
    assert!(
        stdout(&o).contains("cuda moe:           the tensor-core form (mma.sync, activations"),
        "{}",
        stdout(&o)
    );
    let o = kvserve(&[
        "info",
        "--cuda-prefill-tensor-cores",
        "--cuda-gemm-tensor-cores",
    ]);
    assert!(
        stdout(&o).contains("cuda prefill:       paged_prefill on the tensor cores"),
        "{}",
        stdout(&o)
    );
    assert!(
        stdout(&o)
            .contains("cuda own gemm:      bf16 weights of batches over 8 rows on the tensor"),
        "{}",
        stdout(&o)
    );
    for command in ["serve", "bench"] {
        let o = kvserve(&[
            command,
            "--cuda-moe-tensor-cores",
            "--cuda-gemm-tensor-cores",
            "--help",
        ]);
        assert!(o.status.success(), "{command}: {}", stderr(&o));
    }
    let o = kvserve(&["info", "--cuda-graph-max-bs", "8"]);
    let want = if cfg!(any(feature = "cuda", feature = "cuda-13")) {
        "cuda graphs:        decode batches padded to bs [1, 2, 4, 8]"
    } else {
        "cuda graphs:        off: the cuda backend is not compiled"
    };
    assert!(stdout(&o).contains(want), "{want:?} in {}", stdout(&o));
}

/// A config file's keys are flags: they are validated like flags, and the command line wins.
#[test]
fn config_file_gives_flags_and_the_command_line_wins() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let json = dir.join("bench-config.json");
    let config = tmp(
        "bench.toml",
        &format!(
            r#"
workload = "random"
num_prompts = 6
random-input-len = 40
random-output-len = 3
random-range-ratio = 1.0
request-rate = "inf"
max-concurrency = 2
page-size = 8
quiet = true
json = "{}"
plot = "{}"
"#,
            json.display(),
            dir.join("bench-config.png").display()
        ),
    );
    let o = kvserve(&[
        "bench",
        "--config",
        config.to_str().unwrap(),
        "--num-prompts",
        "5",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("[radix] 5 requests (0 aborted)"), "{text}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v[0]["prompt_tokens"], 5 * 40);
    assert_eq!(v[0]["output_tokens"], 5 * 3);
    // Random prompts share nothing.
    assert_eq!(v[0]["cached_tokens"], 0);

    let bad = tmp("bad.toml", "page-size = \"big\"\n");
    assert_fails(
        &["bench", "--config", bad.to_str().unwrap()],
        &["--page-size", "big"],
    );
    let unknown = tmp("unknown.toml", "no-such-flag = 1\n");
    assert_fails(
        &["bench", "--config", unknown.to_str().unwrap()],
        &["--no-such-flag", "--config"],
    );
    assert_fails(
        &["bench", "--config", "/nonexistent/kvserve.toml"],
        &["/nonexistent/kvserve.toml"],
    );
    let nested = tmp("nested.toml", "[engine]\npage-size = 8\n");
    assert_fails(
        &["serve", "--config", nested.to_str().unwrap()],
        &["sections are not supported"],
    );
}

#[test]
fn engine_flags_are_validated_naming_the_flag() {
    assert_fails(
        &["bench", "--mem-fraction-static", "1.5", "--quiet"],
        &["--mem-fraction-static", "(0, 1]"],
    );
    // wgpu cannot tell its adapter's memory: refused before anything loads.
    assert_fails(
        &[
            "bench",
            "--backend",
            "wgpu",
            "--mem-fraction-static",
            "0.5",
            "--quiet",
        ],
        &["--mem-fraction-static", "--max-total-tokens"],
    );
    assert_fails(&["bench", "--max-concurrency", "0"], &["--max-concurrency"]);
    assert_fails(
        &[
            "bench",
            "--random-range-ratio",
            "2",
            "--workload",
            "random",
            "--quiet",
        ],
        &["--random-range-ratio"],
    );
    assert_fails(
        &[
            "bench",
            "--compare-no-cache",
            "--disable-radix-cache",
            "--quiet",
        ],
        &["--compare-no-cache"],
    );
    assert_fails(
        &["bench", "--url", "https://example.com", "--quiet"],
        &["--url", "http://"],
    );
    assert_fails(
        &["bench", "--url", "http://127.0.0.1:9", "--compare-no-cache"],
        &["--compare-no-cache"],
    );
    assert_fails(&["bench", "--model", "x"], &["--url"]);
}

/// Without `XDG_RUNTIME_DIR`, Mesa's drivers (probed by `info`) would print an error of their
/// own; kvserve points the variable at a private directory first, so stderr stays clean.
#[test]
fn no_alarming_output_without_xdg_runtime_dir() {
    for args in [&["info"][..], &["info", "--json"][..]] {
        let o = Command::new(env!("CARGO_BIN_EXE_kvserve"))
            .args(args)
            .env_remove("XDG_RUNTIME_DIR")
            .output()
            .expect("run kvserve");
        let err = stderr(&o);
        assert!(o.status.success(), "{args:?}: {err}");
        assert!(!err.contains("XDG_RUNTIME_DIR"), "{args:?}: {err}");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_kvserve"))
        .args(["info"])
        .env("XDG_RUNTIME_DIR", "/nonexistent/runtime")
        .output()
        .expect("run kvserve");
    assert!(!stderr(&o).contains("XDG_RUNTIME_DIR"), "{}", stderr(&o));
}

/// A small `MistralForCausalLM` checkpoint with a sliding window of `window` tokens: its
/// config.json and random f32 weights in `dir`.
fn write_mistral(dir: &std::path::Path, window: usize) {
    use safetensors::tensor::{Dtype, TensorView};
    std::fs::create_dir_all(dir).unwrap();
    let config = serde_json::json!({
        "architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "vocab_size": 512, "sliding_window": window,
    })
    .to_string();
    std::fs::write(dir.join("config.json"), &config).unwrap();
    let parsed = model::ModelConfig::from_json_str(&config).unwrap();
    let weights = model::tiny::random_weights(&parsed, 1);
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = weights
        .iter()
        .map(|(name, t)| {
            let b = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name.clone(), t.shape.clone(), b)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// Mistral's sliding window is not applied, so a context longer than the window is refused
/// naming `sliding_window` (the default context of `bench` is the workload's longest request);
/// within the window the model runs.
#[test]
fn mistral_is_served_only_within_its_sliding_window() {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let dir = tmp.join("mistral-window-64");
    write_mistral(&dir, 64);
    let bench = |system_len: &str, extra: &[&str]| {
        let mut args = vec![
            "bench",
            "--model-path",
            dir.to_str().unwrap(),
            "--vocab-size",
            "512",
            "--gsp-num-groups",
            "1",
            "--gsp-prompts-per-group",
            "2",
            "--gsp-system-prompt-len",
            system_len,
            "--gsp-question-len",
            "8",
            "--gsp-output-len",
            "4",
            "--request-rate",
            "inf",
            "--quiet",
            "--json",
        ];
        let json = tmp.join("mistral-bench.json");
        let png = tmp.join("mistral-bench.png");
        args.push(json.to_str().unwrap());
        args.extend(["--plot", png.to_str().unwrap()]);
        args.extend(extra);
        kvserve(&args)
    };
    // 32 + 8 + 4 tokens: inside the window.
    let o = bench("32", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("[radix] 2 requests (0 aborted)"),
        "{}",
        stdout(&o)
    );
    // 96 + 8 + 4 tokens: beyond it, by default and when asked for.
    for (system, extra) in [("96", &[][..]), ("32", &["--context-length", "65"][..])] {
        let o = bench(system, extra);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        for needle in [
            "sliding_window",
            "--context-length 64",
            "MistralForCausalLM",
        ] {
            assert!(err.contains(needle), "{needle:?} in {err}");
        }
    }
}

#[test]
fn transfer_bench_json_has_both_throughputs() {
    for backend in ["tcp", "shm"] {
        let o = kvserve(&[
            "transfer-bench",
            "--backend",
            backend,
            "--block-size",
            "65536",
            "--batch-size",
            "4",
            "--threads",
            "2",
            "--duration",
            "0.3",
            "--format",
            "json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        assert!(v["gbps"].as_f64().unwrap() > 0.0, "{v}");
        assert!(v["baseline_gbps"].as_f64().unwrap() > 0.0, "{v}");
    }
    assert_fails(
        &["transfer-bench", "--backend", "nixl"],
        &["--backend", "tcp or shm"],
    );
    assert_fails(&["transfer-bench", "--duration", "0"], &["--duration"]);
}

#[test]
fn sim_dp_json_plots_and_bad_flags() {
    let png = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sim_dp.png");
    let ttft = png.with_file_name("sim_dp-ttft.png");
    let _ = std::fs::remove_file(&png);
    let _ = std::fs::remove_file(&ttft);
    let gsp = [
        "sim",
        "--workload",
        "gsp",
        "--gsp-num-groups",
        "4",
        "--gsp-prompts-per-group",
        "3",
        "--gsp-system-prompt-len",
        "128",
        "--gsp-question-len",
        "16",
        "--gsp-output-len",
        "4",
        "--request-rate",
        "8",
        "--page-size",
        "16",
        "--max-total-tokens",
        "512",
    ];
    let mut args = gsp.to_vec();
    args.extend([
        "--dp",
        "1,2",
        "--router-policy",
        "cache_aware,kv_events",
        "--format",
        "json",
        "--quiet",
        "--plot",
        png.to_str().unwrap(),
    ]);
    let o = kvserve(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let keys: Vec<(u64, &str)> = lines
        .iter()
        .map(|v| {
            (
                v["dp"].as_u64().unwrap(),
                v["router_policy"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        keys,
        [
            (1, "cache_aware"),
            (1, "kv_events"),
            (2, "cache_aware"),
            (2, "kv_events")
        ]
    );
    for v in &lines {
        let routed: u64 = v["routed"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .sum();
        assert_eq!(routed, 12, "{v}");
        assert!(v["hit_rate"].as_f64().unwrap() > 0.0, "{v}");
    }
    assert!(png.exists() && ttft.exists());

    let with = |extra: &[&'static str]| {
        let mut a = gsp.to_vec();
        a.extend_from_slice(extra);
        a
    };
    assert_fails(&with(&["--dp", "0"]), &["--dp"]);
    assert_fails(
        &with(&["--dp", "2", "--router-policy", "fastest"]),
        &["--router-policy"],
    );
    assert_fails(
        &with(&["--dp", "2", "--enable-hierarchical-cache"]),
        &["--enable-hierarchical-cache", "no host tier"],
    );
    assert_fails(
        &with(&["--dp", "2", "--cache-threshold", "2"]),
        &["--cache-threshold"],
    );
}
