//! The router's own Prometheus metrics (`GET /metrics`), named as SGLang's router's
//! (`sgl_router_*`) under the `kvserve_router:` prefix:
//! - `requests_total{route}` and `request_errors_total{route,error_type}`;
//! - `pd_prefill_requests_total{worker}`, `pd_decode_requests_total{worker}` and their
//!   `_errors_total` (a worker that could not be reached, answered 5xx, or answered something
//!   that is not JSON);
//! - regular mode: `worker_requests_total{worker}` and `worker_errors_total{worker}`;
//! - `pd_request_duration_seconds{route}`: from the client's request to the end of the
//!   router's answer (a stream's last byte, or the client disconnecting), in both modes.
//!
//! Routes are listed in name order, workers in the order they were given (each from zero), so
//! the text is in a stable order.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

/// Metric name prefix.
pub const PREFIX: &str = "kvserve_router:";

/// Request latency buckets in seconds (SGLang's router's, from 1 ms to 4 min).
const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 45.0, 60.0,
    90.0, 120.0, 180.0, 240.0,
];

/// The role of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// A prefill server.
    Prefill,
    /// A decode server.
    Decode,
    /// A regular worker (`--worker-urls`).
    Worker,
}

impl Role {
    /// `prefill` or `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Worker => "worker",
        }
    }

    /// How messages name a worker of this role: `prefill worker`, `decode worker`, `worker`.
    pub fn worker_noun(self) -> &'static str {
        match self {
            Role::Prefill => "prefill worker",
            Role::Decode => "decode worker",
            Role::Worker => "worker",
        }
    }
}

#[derive(Debug, Clone)]
struct Histogram {
    /// Per bucket (not cumulative); the last entry is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; DURATION_BUCKETS.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }
}

#[derive(Debug, Default)]
struct Data {
    requests: BTreeMap<String, u64>,
    errors: BTreeMap<(String, String), u64>,
    /// (role, URL, requests, errors), in the order the workers were given.
    workers: Vec<(Role, String, u64, u64)>,
    durations: BTreeMap<String, Histogram>,
}

/// What the router counts; shared by every request.
#[derive(Debug, Default)]
pub struct RouterMetrics {
    data: Mutex<Data>,
}

impl RouterMetrics {
    /// Counters with a zero series for each of `workers` (role and URL), listed in this order.
    pub fn with_workers(workers: impl IntoIterator<Item = (Role, String)>) -> Self {
        let m = RouterMetrics::default();
        m.with(|d| d.workers = workers.into_iter().map(|(r, w)| (r, w, 0, 0)).collect());
        m
    }

    /// The series of `worker` (added at the end if new).
    fn worker<'a>(d: &'a mut Data, role: Role, worker: &str) -> &'a mut (Role, String, u64, u64) {
        let i = match d
            .workers
            .iter()
            .position(|(r, w, ..)| *r == role && w == worker)
        {
            Some(i) => i,
            None => {
                d.workers.push((role, worker.to_string(), 0, 0));
                d.workers.len() - 1
            }
        };
        &mut d.workers[i]
    }

    fn with<T>(&self, f: impl FnOnce(&mut Data) -> T) -> T {
        f(&mut self.data.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A request arrived at `route`.
    pub fn request(&self, route: &str) {
        self.with(|d| *d.requests.entry(route.into()).or_default() += 1);
    }

    /// A request at `route` failed with `error_type` (`bad_request`, `prefill_error`,
    /// `decode_error`, …).
    pub fn error(&self, route: &str, error_type: &str) {
        self.with(|d| {
            *d.errors
                .entry((route.into(), error_type.into()))
                .or_default() += 1
        });
    }

    /// A request was sent to `worker`.
    pub fn worker_request(&self, role: Role, worker: &str) {
        self.with(|d| Self::worker(d, role, worker).2 += 1);
    }

    /// `worker` failed a request.
    pub fn worker_error(&self, role: Role, worker: &str) {
        self.with(|d| Self::worker(d, role, worker).3 += 1);
    }

    /// A request at `route` took `took` from arrival to its answer's end.
    pub fn duration(&self, route: &str, took: Duration) {
        let s = took.as_secs_f64();
        self.with(|d| {
            let h = d.durations.entry(route.into()).or_default();
            h.counts[DURATION_BUCKETS.partition_point(|&b| b < s)] += 1;
            h.sum += s;
            h.count += 1;
        });
    }

    /// The Prometheus text (format 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.with(|d| {
            header(&mut out, "requests_total", "Requests received, per route.", "counter");
            for (route, n) in &d.requests {
                line(&mut out, "requests_total", &[("route", route)], *n);
            }
            let name = "request_errors_total";
            header(&mut out, name, "Requests answered with an error, per route and error type.", "counter");
            for ((route, kind), n) in &d.errors {
                line(&mut out, name, &[("route", route), ("error_type", kind)], *n);
            }
            for role in [Role::Prefill, Role::Decode] {
                let r = role.as_str();
                let name = format!("pd_{r}_requests_total");
                header(&mut out, &name, &format!("Requests sent to each {r} worker."), "counter");
                for (_, w, n, _) in d.workers.iter().filter(|(x, ..)| *x == role) {
                    line(&mut out, &name, &[("worker", w)], *n);
                }
                let name = format!("pd_{r}_errors_total");
                let help = format!(
                    "Requests a {r} worker failed (unreachable, 5xx, or an answer that is not JSON)."
                );
                header(&mut out, &name, &help, "counter");
                for (_, w, _, n) in d.workers.iter().filter(|(x, ..)| *x == role) {
                    line(&mut out, &name, &[("worker", w)], *n);
                }
            }
            if d.workers.iter().any(|(x, ..)| *x == Role::Worker) {
                let regular = d.workers.iter().filter(|(x, ..)| *x == Role::Worker);
                let name = "worker_requests_total";
                header(&mut out, name, "Requests sent to each regular worker (retries included).", "counter");
                for (_, w, n, _) in regular.clone() {
                    line(&mut out, name, &[("worker", w)], *n);
                }
                let name = "worker_errors_total";
                header(&mut out, name, "Requests a regular worker failed (unreachable, 5xx, or broken off).", "counter");
                for (_, w, _, n) in regular {
                    line(&mut out, name, &[("worker", w)], *n);
                }
            }
            let name = "pd_request_duration_seconds";
            header(&mut out, name, "Time from a request's arrival to the end of its answer.", "histogram");
            for (route, h) in &d.durations {
                let mut cumulative = 0;
                for (i, c) in h.counts.iter().enumerate() {
                    cumulative += c;
                    let le = DURATION_BUCKETS.get(i).map_or("+Inf".into(), |b| b.to_string());
                    let labels = [("route", route.as_str()), ("le", le.as_str())];
                    line(&mut out, &format!("{name}_bucket"), &labels, cumulative);
                }
                let _ = writeln!(out, "{PREFIX}{name}_sum{{route=\"{}\"}} {}", escape(route), h.sum);
                line(&mut out, &format!("{name}_count"), &[("route", route)], h.count);
            }
        });
        out
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {PREFIX}{name} {help}");
    let _ = writeln!(out, "# TYPE {PREFIX}{name} {kind}");
}

fn line(out: &mut String, name: &str, labels: &[(&str, &str)], v: u64) {
    let labels: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    let _ = writeln!(out, "{PREFIX}{name}{{{}}} {v}", labels.join(","));
}

/// A label value escaped as the exposition format wants (`\`, `"`, newline).
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_counts_per_route_and_worker() {
        let m = RouterMetrics::with_workers([(Role::Decode, "http://d:2".to_string())]);
        m.request("/generate");
        m.request("/generate");
        m.error("/generate", "prefill_error");
        m.worker_request(Role::Prefill, "http://p:1");
        m.worker_error(Role::Prefill, "http://p:1");
        m.worker_request(Role::Decode, "http://d:2");
        m.duration("/generate", Duration::from_millis(30));
        let text = m.render();
        for want in [
            "kvserve_router:requests_total{route=\"/generate\"} 2",
            "kvserve_router:request_errors_total{route=\"/generate\",error_type=\"prefill_error\"} 1",
            "kvserve_router:pd_prefill_requests_total{worker=\"http://p:1\"} 1",
            "kvserve_router:pd_prefill_errors_total{worker=\"http://p:1\"} 1",
            "kvserve_router:pd_decode_requests_total{worker=\"http://d:2\"} 1",
            "kvserve_router:pd_decode_errors_total{worker=\"http://d:2\"} 0",
            "kvserve_router:pd_request_duration_seconds_bucket{route=\"/generate\",le=\"0.025\"} 0",
            "kvserve_router:pd_request_duration_seconds_bucket{route=\"/generate\",le=\"0.05\"} 1",
            "kvserve_router:pd_request_duration_seconds_count{route=\"/generate\"} 1",
        ] {
            assert!(text.contains(want), "{want} missing in\n{text}");
        }
        assert_eq!(escape("a\"b\\"), "a\\\"b\\\\");
    }
}
