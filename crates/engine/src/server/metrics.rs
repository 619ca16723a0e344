//! `GET /metrics`: Prometheus text exposition (format 0.0.4), names as SGLang's with the
//! `kvserve:` prefix.
//!
//! Two sources, nothing counted twice:
//! - the engine loop's [`EngineMetricsSnapshot`]: running / queued requests, KV tokens used,
//!   token usage, cache hit rate, prompt / generation / cached token counters, recent
//!   generation throughput;
//! - [`ServerMetrics`], kept by the HTTP layer where a request's events arrive (as SGLang's
//!   tokenizer manager does): requests received, finished by reason, aborted, rejected, and the
//!   time-to-first-token, inter-token and end-to-end latency histograms.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::engine_metrics::{EngineMetricsSnapshot, HiCacheMetrics, PdMetrics};

/// Metric name prefix.
pub const PREFIX: &str = "kvserve:";

/// A Prometheus histogram with fixed upper bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistogramData>,
}

#[derive(Debug, Clone, Default)]
struct HistogramData {
    /// Per bucket (not cumulative); the last entry is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// A histogram with these (increasing) upper bounds; `+Inf` is implied.
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            inner: Mutex::new(HistogramData {
                counts: vec![0; bounds.len() + 1],
                ..HistogramData::default()
            }),
        }
    }

    /// Records `v` `times` times.
    pub fn observe_n(&self, v: f64, times: u64) {
        let i = self.bounds.partition_point(|&b| b < v);
        let mut d = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        d.counts[i] += times;
        d.sum += v * times as f64;
        d.count += times;
    }

    /// Records `v`.
    pub fn observe(&self, v: f64) {
        self.observe_n(v, 1);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let d = self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone();
        header(out, name, help, "histogram");
        let mut cumulative = 0;
        for (i, c) in d.counts.iter().enumerate() {
            cumulative += c;
            let le = self
                .bounds
                .get(i)
                .map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{PREFIX}{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{PREFIX}{name}_sum {}", d.sum);
        let _ = writeln!(out, "{PREFIX}{name}_count {}", d.count);
    }
}

/// Time to first token (SGLang's buckets, with finer ones below 0.1 s for small models).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0,
    40.0, 60.0, 80.0, 120.0, 160.0,
];
/// Inter-token latency (SGLang's buckets, with finer ones below 2 ms).
const ITL_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
    0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0,
];
/// End-to-end request latency.
const E2E_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0,
    80.0, 100.0, 200.0, 400.0, 800.0,
];

/// How a request ended, as its client saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A stop token or a stop string.
    Stop,
    /// The token limit.
    Length,
    /// Aborted by the engine (shutdown, out of memory) or by the client disconnecting.
    Abort,
}

/// A PD server's queue gauges (SGLang's names) and transfer counters.
fn render_pd(out: &mut String, pd: &PdMetrics) {
    for (name, v) in &pd.queues {
        header(out, name, "Requests in this PD queue.", "gauge");
        let _ = writeln!(out, "{PREFIX}{name} {v}");
    }
    let st = &pd.stats;
    let counters: [(&str, &str, f64); 4] = [
        (
            "kv_transfer_success_total",
            "Requests whose KV transfer succeeded.",
            st.success_total as f64,
        ),
        (
            "kv_transfer_failed_total",
            "Requests whose KV transfer failed (timeouts, dead peers, corrupted frames, aborts).",
            st.failed_total as f64,
        ),
        (
            "kv_transfer_bytes_total",
            "KV bytes moved by successful transfers (sent on prefill, received on decode).",
            st.bytes as f64,
        ),
        (
            "kv_transfer_seconds_total",
            "Seconds spent in successful transfers.",
            st.transfer_seconds,
        ),
    ];
    for (name, help, v) in counters {
        header(out, name, help, "counter");
        let _ = writeln!(out, "{PREFIX}{name} {v}");
    }
}

fn render_hicache(out: &mut String, h: &HiCacheMetrics) {
    for (name, help, v) in h.gauges() {
        header(out, name, help, "gauge");
        let _ = writeln!(out, "{PREFIX}{name} {v}");
    }
    for (name, help, v) in h.counters() {
        header(out, name, help, "counter");
        let _ = writeln!(out, "{PREFIX}{name} {v}");
    }
}

/// What the HTTP layer counts.
#[derive(Debug)]
pub struct ServerMetrics {
    requests: AtomicU64,
    finished: [AtomicU64; 3],
    rejected_queue_full: AtomicU64,
    rejected_invalid: AtomicU64,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        ServerMetrics {
            requests: AtomicU64::new(0),
            finished: Default::default(),
            rejected_queue_full: AtomicU64::new(0),
            rejected_invalid: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }
}

impl ServerMetrics {
    /// Starts timing a request submitted to the engine now.
    pub fn start(self: &Arc<Self>) -> RequestTimer {
        self.requests.fetch_add(1, Relaxed);
        RequestTimer {
            metrics: self.clone(),
            start: Instant::now(),
            last_token: None,
            ended: false,
        }
    }

    fn rejected(&self, queue_full: bool) {
        let c = if queue_full {
            &self.rejected_queue_full
        } else {
            &self.rejected_invalid
        };
        c.fetch_add(1, Relaxed);
    }

    /// The exposition text; with `pd`, a prefill or decode server's queues and transfer
    /// counters too.
    pub fn render(
        &self,
        e: &EngineMetricsSnapshot,
        pd: Option<&PdMetrics>,
        hicache: Option<&HiCacheMetrics>,
    ) -> String {
        let mut out = String::with_capacity(8192);
        if let Some(pd) = pd {
            render_pd(&mut out, pd);
        }
        if let Some(h) = hicache {
            render_hicache(&mut out, h);
        }
        let gauges: [(&str, &str, f64); 7] = [
            (
                "num_running_reqs",
                "Requests in the running batch.",
                e.num_running_reqs as f64,
            ),
            (
                "num_queue_reqs",
                "Requests waiting to be scheduled.",
                e.num_queue_reqs as f64,
            ),
            (
                "num_used_tokens",
                "KV cache slots in use (requests and the prefix cache).",
                e.num_used_tokens as f64,
            ),
            (
                "max_total_num_tokens",
                "KV cache pool size in tokens.",
                e.max_total_num_tokens as f64,
            ),
            (
                "token_usage",
                "Used / total KV cache tokens.",
                e.token_usage(),
            ),
            (
                "cache_hit_rate",
                "Prompt tokens served from the prefix cache / prompt tokens, since start.",
                e.cache_hit_rate(),
            ),
            (
                "gen_throughput",
                "Generated tokens per second over the last 10 s.",
                e.gen_throughput,
            ),
        ];
        for (name, help, v) in gauges {
            header(&mut out, name, help, "gauge");
            let _ = writeln!(out, "{PREFIX}{name} {v}");
        }
        let counters: [(&str, &str, u64); 4] = [
            (
                "prompt_tokens_total",
                "Prompt tokens admitted (re-admissions after retraction included).",
                e.prompt_tokens_total,
            ),
            (
                "generation_tokens_total",
                "Tokens generated.",
                e.generation_tokens_total,
            ),
            (
                "cached_tokens_total",
                "Prompt tokens served from the prefix cache.",
                e.cached_tokens_total,
            ),
            (
                "num_requests_total",
                "Requests submitted to the engine.",
                self.requests.load(Relaxed),
            ),
        ];
        for (name, help, v) in counters {
            header(&mut out, name, help, "counter");
            let _ = writeln!(out, "{PREFIX}{name} {v}");
        }
        let name = "num_finished_requests_total";
        header(
            &mut out,
            name,
            "Requests finished, by finish reason.",
            "counter",
        );
        for (reason, c) in ["stop", "length", "abort"].iter().zip(&self.finished) {
            let _ = writeln!(
                out,
                "{PREFIX}{name}{{finish_reason=\"{reason}\"}} {}",
                c.load(Relaxed)
            );
        }
        let aborted = self.finished[Outcome::Abort as usize].load(Relaxed);
        header(
            &mut out,
            "num_aborted_requests_total",
            "Requests aborted (client disconnected, shutdown).",
            "counter",
        );
        let _ = writeln!(out, "{PREFIX}num_aborted_requests_total {aborted}");
        let name = "num_rejected_requests_total";
        header(
            &mut out,
            name,
            "Requests the engine refused, by reason.",
            "counter",
        );
        for (reason, c) in [
            ("queue_full", &self.rejected_queue_full),
            ("invalid", &self.rejected_invalid),
        ] {
            let _ = writeln!(
                out,
                "{PREFIX}{name}{{reason=\"{reason}\"}} {}",
                c.load(Relaxed)
            );
        }
        self.ttft.render(
            &mut out,
            "time_to_first_token_seconds",
            "Time to first token in seconds.",
        );
        self.itl.render(
            &mut out,
            "inter_token_latency_seconds",
            "Time between consecutive output tokens in seconds.",
        );
        self.e2e.render(
            &mut out,
            "e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
        );
        out
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {PREFIX}{name} {help}");
    let _ = writeln!(out, "# TYPE {PREFIX}{name} {kind}");
}

/// Times one request: TTFT at its first tokens, inter-token latency after, end-to-end and the
/// outcome at its end. Dropped before [`end`](Self::end), it counts as aborted (the client
/// went away).
#[derive(Debug)]
pub struct RequestTimer {
    metrics: Arc<ServerMetrics>,
    start: Instant,
    last_token: Option<Instant>,
    ended: bool,
}

impl RequestTimer {
    /// `n` new tokens arrived.
    pub fn tokens(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        match self.last_token {
            None => self.metrics.ttft.observe((now - self.start).as_secs_f64()),
            // The interval is shared by the tokens that arrived together (as SGLang).
            Some(t) => self
                .metrics
                .itl
                .observe_n((now - t).as_secs_f64() / n as f64, n as u64),
        }
        self.last_token = Some(now);
    }

    /// The engine refused the request (`queue_full`: a 503); it is not timed.
    pub fn rejected(&mut self, queue_full: bool) {
        self.ended = true;
        self.metrics.rejected(queue_full);
    }

    /// The request ended with `outcome`.
    pub fn end(&mut self, outcome: Outcome) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        self.metrics.finished[outcome as usize].fetch_add(1, Relaxed);
        self.metrics.e2e.observe(self.start.elapsed().as_secs_f64());
    }
}

impl Drop for RequestTimer {
    fn drop(&mut self) {
        self.end(Outcome::Abort);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_end_at_the_count() {
        static B: &[f64] = &[0.1, 1.0];
        let h = Histogram::new(B);
        for v in [0.05, 0.1, 0.5, 2.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "help");
        insta::assert_snapshot!(out, @r###"
        # HELP kvserve:x help
        # TYPE kvserve:x histogram
        kvserve:x_bucket{le="0.1"} 2
        kvserve:x_bucket{le="1"} 3
        kvserve:x_bucket{le="+Inf"} 4
        kvserve:x_sum 2.65
        kvserve:x_count 4
        "###);
    }
}
