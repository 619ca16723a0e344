//! `kvserve router`'s flags ([`RouterArgs`], named as SGLang's `sglang_router.launch_router`)
//! and their validated form ([`RouterConfig`]): either the regular workers (`--worker-urls`)
//! or the prefill workers with their bootstrap ports and the decode workers
//! (`--pd-disaggregation`), the selection policies with `cache_aware`'s settings
//! ([`CacheAwareConfig`]), the health checks ([`HealthConfig`]) and the timeouts.
//!
//! A worker URL must be `http://HOST[:PORT][/PATH]` with a host: the router's client speaks
//! plain HTTP, and the host is what it tells the decode server to bootstrap from.

use std::time::Duration;

use clap::{ArgAction, Args, ValueEnum};
use reqwest::Url;

use crate::error::{EngineError, Result};
use crate::setup::source::ModelSource;

/// SGLang's default bootstrap port (the prefill server's `--disaggregation-bootstrap-port`),
/// used for a `--prefill URL` given without one.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// How long the router waits for a TCP connection to a worker before answering 502.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How a worker is picked for each request (SGLang's `--policy` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyKind {
    /// Uniformly at random.
    #[value(name = "random")]
    Random,
    /// In turn, each worker of the role once per round.
    #[value(name = "round_robin", alias = "round-robin")]
    RoundRobin,
    /// The less loaded of two random workers (regular mode).
    #[value(name = "power_of_two", alias = "power-of-two")]
    PowerOfTwo,
    /// Where the prompt's prefix was sent before, unless workers are imbalanced (regular
    /// mode; sgl-router's approximate tree).
    #[value(name = "cache_aware", alias = "cache-aware")]
    CacheAware,
    /// Where the prompt's longest prefix really is cached, from the workers' KV events
    /// (regular mode, with --worker-kv-events).
    #[value(name = "kv_events", alias = "kv-events")]
    KvEvents,
}

impl PolicyKind {
    /// The name as the command line and `/get_server_info` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Random => "random",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::KvEvents => "kv_events",
        }
    }
}

/// Where a worker publishes its KV events (`kv_events`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSource {
    /// The PUB endpoint (`tcp://HOST:PORT`).
    pub endpoint: String,
    /// The replay (ROUTER) endpoint, if the worker has one.
    pub replay: Option<String>,
}

/// `cache_aware`'s settings (sgl-router's flags and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareConfig {
    /// `--cache-threshold`: the matched share of the prompt above which the match decides.
    pub cache_threshold: f32,
    /// `--balance-abs-threshold`: imbalanced only if max − min load exceeds this.
    pub balance_abs_threshold: usize,
    /// `--balance-rel-threshold`: imbalanced only if max load exceeds this × min load.
    pub balance_rel_threshold: f32,
    /// `--eviction-interval`: seconds between trims of the tree.
    pub eviction_interval_secs: u64,
    /// `--max-tree-size`: symbols kept per worker after a trim.
    pub max_tree_size: usize,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        CacheAwareConfig {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval_secs: 120,
            max_tree_size: 1 << 26,
        }
    }
}

impl CacheAwareConfig {
    /// These settings, or an error naming the flag whose value is out of range: the cache
    /// threshold is a share in [0, 1], the relative balance threshold a finite number ≥ 0, and
    /// an eviction interval of 0 means 1 s (a trim every 0 s would spin).
    pub fn checked(self) -> Result<CacheAwareConfig> {
        if !(self.cache_threshold.is_finite() && (0.0..=1.0).contains(&self.cache_threshold)) {
            return Err(EngineError::arg(
                "--cache-threshold",
                format!("{} is not between 0 and 1", self.cache_threshold),
            ));
        }
        if !(self.balance_rel_threshold.is_finite() && self.balance_rel_threshold >= 0.0) {
            return Err(EngineError::arg(
                "--balance-rel-threshold",
                format!(
                    "{} is not a non-negative number",
                    self.balance_rel_threshold
                ),
            ));
        }
        Ok(CacheAwareConfig {
            eviction_interval_secs: self.eviction_interval_secs.max(1),
            ..self
        })
    }
}

/// The regular router's health checks (sgl-router's flags and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// `--health-check-interval-secs`: time between two checks of every worker.
    pub interval: Duration,
    /// `--health-check-timeout-secs`: a `/health` not answered 2xx within this fails.
    pub timeout: Duration,
    /// `--health-failure-threshold`: failed checks in a row that make a worker unhealthy.
    pub failure_threshold: u32,
    /// `--health-success-threshold`: passed checks in a row that make it healthy again.
    pub success_threshold: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval: Duration::from_secs(60),
            timeout: Duration::from_secs(5),
            failure_threshold: 3,
            success_threshold: 2,
        }
    }
}

/// Flags of `kvserve router` (SGLang's `launch_router` names and defaults).
#[derive(Debug, Clone, Args)]
pub struct RouterArgs {
    /// The regular workers: each request goes to one of them, chosen by --policy.
    #[arg(long, value_name = "URL", num_args = 1.., action = ArgAction::Append)]
    pub worker_urls: Vec<String>,
    /// kv_events: each regular worker's KV-event endpoint (its --kv-events-config
    /// `endpoint`, e.g. tcp://127.0.0.1:5557), in the order of --worker-urls.
    #[arg(long, value_name = "ENDPOINT", num_args = 1.., action = ArgAction::Append)]
    pub worker_kv_events: Vec<String>,
    /// kv_events: each regular worker's replay endpoint (its --kv-events-config
    /// `replay_endpoint`), in the order of --worker-urls; a sequence gap is then filled from it.
    #[arg(long, value_name = "ENDPOINT", num_args = 1.., action = ArgAction::Append)]
    pub worker_kv_events_replay: Vec<String>,
    /// kv_events: the workers' event topic (their --kv-events-config `topic`).
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Prefill-decode disaggregation: each request goes to a prefill and a decode server at
    /// once (with --prefill and --decode instead of --worker-urls).
    #[arg(long)]
    pub pd_disaggregation: bool,
    /// A prefill server: its URL and, optionally, its bootstrap port (default 8998).
    /// Repeat for several prefill servers. (The values of all occurrences, in order: a value
    /// without `://` is the bootstrap port of the URL before it.)
    #[arg(long, value_names = ["URL", "BOOTSTRAP_PORT"], num_args = 1..=2, action = ArgAction::Append)]
    pub prefill: Vec<String>,
    /// A decode server's URL. Repeat for several decode servers.
    #[arg(long, value_name = "URL", action = ArgAction::Append)]
    pub decode: Vec<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// How workers are picked (regular mode), and prefill and decode workers (PD mode);
    /// sgl-router's default, cache_aware.
    #[arg(long, value_enum, default_value_t = PolicyKind::CacheAware)]
    pub policy: PolicyKind,
    /// The prefill workers' policy (default: --policy).
    #[arg(long, value_enum)]
    pub prefill_policy: Option<PolicyKind>,
    /// The decode workers' policy (default: --policy).
    #[arg(long, value_enum)]
    pub decode_policy: Option<PolicyKind>,
    /// Longest wait in seconds for the next bytes of a worker's response (SGLang's default).
    #[arg(long, value_name = "SECS", default_value_t = 1800, value_parser = clap::value_parser!(u64).range(1..))]
    pub request_timeout_secs: u64,
    /// cache_aware: the matched share of a prompt (0 to 1) above which the request goes to
    /// the worker holding the match; below it, to the worker with the smallest tree.
    #[arg(long, default_value_t = 0.3)]
    pub cache_threshold: f32,
    /// cache_aware: load-balance (least loaded worker) when max − min in-flight requests
    /// exceeds this …
    #[arg(long, default_value_t = 64)]
    pub balance_abs_threshold: usize,
    /// … and max exceeds this × min.
    #[arg(long, default_value_t = 1.5)]
    pub balance_rel_threshold: f32,
    /// cache_aware: seconds between trims of the approximate tree.
    #[arg(long, value_name = "SECS", default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub eviction_interval: u64,
    /// cache_aware: prompt symbols (characters or token ids) kept per worker after a trim.
    #[arg(long, default_value_t = 1 << 26)]
    pub max_tree_size: usize,
    /// Seconds between health checks (`GET /health`) of every regular worker.
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub health_check_interval_secs: u64,
    /// Seconds a worker's `/health` may take.
    #[arg(long, value_name = "SECS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub health_check_timeout_secs: u64,
    /// Failed checks in a row before a worker is skipped (a request that cannot reach a
    /// worker skips it at once).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub health_failure_threshold: u32,
    /// Passed checks in a row before a skipped worker gets requests again.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub health_success_threshold: u32,
    /// The workers' model directory (its tokenizer.json and chat template), or `tiny` for
    /// workers on the built-in model: text prompts (`text`, a text `prompt`, chat `messages`)
    /// are then tokenized as the workers do, and every policy routes on token ids, so
    /// `kv_events` matches them against the pages the workers hold. Without it, text routes
    /// as text (`kv_events` then balances text by load only).
    #[arg(long, value_name = "DIR")]
    pub tokenizer_path: Option<std::path::PathBuf>,
}

/// A worker's address: the base URL requests are sent under and the host it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerUrl {
    base: String,
    host: String,
}

impl WorkerUrl {
    /// Parses `http://HOST[:PORT][/PATH]`; the error says what is wrong with `s`.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        let url = Url::parse(s.trim())
            .map_err(|e| format!("{s:?} is not a URL ({e}); expected http://HOST:PORT"))?;
        if url.scheme() != "http" {
            return Err(format!(
                "{s:?}: expected an http:// URL (the router's client speaks plain HTTP only)"
            ));
        }
        let host = match url.host_str() {
            Some(h) if !h.is_empty() => h.to_string(),
            _ => return Err(format!("{s:?} names no host; expected http://HOST:PORT")),
        };
        if url.query().is_some() || url.fragment().is_some() {
            return Err(format!("{s:?}: a worker URL has no query or fragment"));
        }
        Ok(WorkerUrl {
            base: url.as_str().trim_end_matches('/').to_string(),
            host,
        })
    }

    /// The URL that endpoint paths are appended to, without a trailing `/`.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The host (an IPv6 address in brackets), as injected into `bootstrap_host`.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// `base` + `path` (`path` starts with `/`).
    pub fn join(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl std::fmt::Display for WorkerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.base)
    }
}

/// A prefill server: where to send requests and the bootstrap port its KV manager listens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillWorker {
    /// The server's HTTP address.
    pub url: WorkerUrl,
    /// Its `--disaggregation-bootstrap-port`, injected into `bootstrap_port`.
    pub bootstrap_port: u16,
}

/// The router's validated configuration: regular mode when `workers` is not empty, PD mode
/// (`prefill` and `decode` not empty) otherwise.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    /// The regular workers at start (more may be added at run time); empty in PD mode.
    pub workers: Vec<WorkerUrl>,
    /// kv_events: the KV-event endpoints of each of `workers` (empty otherwise).
    pub kv_events: Vec<EventSource>,
    /// kv_events: the topic the router subscribes to.
    pub kv_events_topic: String,
    /// How regular workers are picked.
    pub policy: PolicyKind,
    /// `cache_aware`'s settings.
    pub cache_aware: CacheAwareConfig,
    /// The regular workers' health checks.
    pub health: HealthConfig,
    /// PD mode: at least one prefill server.
    pub prefill: Vec<PrefillWorker>,
    /// PD mode: at least one decode server.
    pub decode: Vec<WorkerUrl>,
    /// How prefill workers are picked.
    pub prefill_policy: PolicyKind,
    /// How decode workers are picked.
    pub decode_policy: PolicyKind,
    /// Longest wait for a TCP connection to a worker.
    pub connect_timeout: Duration,
    /// Longest wait for the next bytes of a worker's response.
    pub request_timeout: Duration,
    /// `--tokenizer-path`: the workers' model, whose tokenizer turns text prompts into the
    /// token ids routed on (`None`: text routes as text).
    pub tokenizer: Option<ModelSource>,
}

impl RouterConfig {
    /// One prefill and one decode worker (bootstrap port [`DEFAULT_BOOTSTRAP_PORT`]), both
    /// policies random, the default timeouts.
    pub fn new(prefill: &str, decode: &str) -> Result<Self> {
        Ok(RouterConfig {
            workers: Vec::new(),
            kv_events: Vec::new(),
            kv_events_topic: String::new(),
            policy: PolicyKind::Random,
            cache_aware: CacheAwareConfig::default(),
            health: HealthConfig::default(),
            prefill: vec![PrefillWorker {
                url: WorkerUrl::parse(prefill).map_err(|m| EngineError::arg("--prefill", m))?,
                bootstrap_port: DEFAULT_BOOTSTRAP_PORT,
            }],
            decode: vec![WorkerUrl::parse(decode).map_err(|m| EngineError::arg("--decode", m))?],
            prefill_policy: PolicyKind::Random,
            decode_policy: PolicyKind::Random,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: Duration::from_secs(1800),
            tokenizer: None,
        })
    }

    /// Regular mode over `workers` with `policy` and the defaults of everything else.
    pub fn regular(workers: &[&str], policy: PolicyKind) -> Result<Self> {
        let workers = parse_workers(workers.iter().map(|s| s.to_string()))?;
        Ok(RouterConfig {
            workers,
            kv_events: Vec::new(),
            kv_events_topic: String::new(),
            policy,
            cache_aware: CacheAwareConfig::default(),
            health: HealthConfig::default(),
            prefill: Vec::new(),
            decode: Vec::new(),
            prefill_policy: policy,
            decode_policy: policy,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: Duration::from_secs(1800),
            tokenizer: None,
        })
    }

    /// Whether this is the PD router.
    pub fn is_pd(&self) -> bool {
        self.workers.is_empty()
    }
}

/// A worker's KV-event endpoint must be `tcp://HOST:PORT` (the message says why not).
pub fn check_endpoint(e: &str) -> std::result::Result<(), String> {
    let ok = e
        .strip_prefix("tcp://")
        .and_then(|r| r.rsplit_once(':'))
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
    if ok {
        Ok(())
    } else {
        Err(format!("{e:?} is not a tcp://HOST:PORT endpoint"))
    }
}

/// `--worker-urls`: parsed, at least one, none twice.
fn parse_workers(urls: impl Iterator<Item = String>) -> Result<Vec<WorkerUrl>> {
    let flag = "--worker-urls";
    let mut out: Vec<WorkerUrl> = Vec::new();
    for u in urls {
        let url = WorkerUrl::parse(&u).map_err(|m| EngineError::arg(flag, m))?;
        if out.contains(&url) {
            return Err(EngineError::arg(flag, format!("{url} is given twice")));
        }
        out.push(url);
    }
    if out.is_empty() {
        return Err(EngineError::arg(flag, "give at least one worker URL"));
    }
    Ok(out)
}

impl RouterArgs {
    /// `--tokenizer-path` as a model source.
    fn tokenizer(&self) -> Option<ModelSource> {
        self.tokenizer_path
            .as_deref()
            .map(ModelSource::from_tokenizer_arg)
    }

    /// The validated configuration; errors name the flag.
    pub fn config(&self) -> Result<RouterConfig> {
        let cache_aware = self.cache_aware()?;
        let health = HealthConfig {
            interval: Duration::from_secs(self.health_check_interval_secs),
            timeout: Duration::from_secs(self.health_check_timeout_secs),
            failure_threshold: self.health_failure_threshold,
            success_threshold: self.health_success_threshold,
        };
        if !self.pd_disaggregation {
            if !self.prefill.is_empty() || !self.decode.is_empty() {
                return Err(EngineError::arg(
                    "--pd-disaggregation",
                    "--prefill and --decode need --pd-disaggregation (regular workers are \
                     given with --worker-urls)",
                ));
            }
            if self.worker_urls.is_empty() {
                return Err(EngineError::arg(
                    "--worker-urls",
                    "give at least one worker URL (or --pd-disaggregation with --prefill \
                     URL [BOOTSTRAP_PORT] and --decode URL)",
                ));
            }
            let policy = self.policy;
            let workers = parse_workers(self.worker_urls.iter().cloned())?;
            let kv_events = self.kv_events(policy, workers.len())?;
            return Ok(RouterConfig {
                workers,
                kv_events,
                kv_events_topic: self.kv_events_topic.clone(),
                policy,
                cache_aware,
                health,
                prefill: Vec::new(),
                decode: Vec::new(),
                prefill_policy: policy,
                decode_policy: policy,
                connect_timeout: DEFAULT_CONNECT_TIMEOUT,
                request_timeout: Duration::from_secs(self.request_timeout_secs),
                tokenizer: self.tokenizer(),
            });
        }
        if !self.worker_urls.is_empty() {
            return Err(EngineError::arg(
                "--worker-urls",
                "regular workers and --pd-disaggregation exclude each other",
            ));
        }
        let prefill_policy = self.prefill_policy.unwrap_or(self.policy);
        let decode_policy = self.decode_policy.unwrap_or(self.policy);
        if prefill_policy == PolicyKind::KvEvents {
            return Err(EngineError::arg(
                "--prefill-policy",
                "kv_events: the PD router does not read KV events (use cache_aware)",
            ));
        }
        if decode_policy == PolicyKind::KvEvents {
            return Err(EngineError::arg(
                "--decode-policy",
                "kv_events: the PD router does not read KV events (use cache_aware)",
            ));
        }
        let prefill = group_prefill(&self.prefill)?
            .iter()
            .map(|values| parse_prefill(values))
            .collect::<Result<Vec<_>>>()?;
        if prefill.is_empty() {
            return Err(EngineError::arg(
                "--prefill",
                "give at least one prefill server",
            ));
        }
        let decode = self
            .decode
            .iter()
            .map(|u| WorkerUrl::parse(u).map_err(|m| EngineError::arg("--decode", m)))
            .collect::<Result<Vec<_>>>()?;
        if decode.is_empty() {
            return Err(EngineError::arg(
                "--decode",
                "give at least one decode server",
            ));
        }
        for (i, url) in decode.iter().enumerate() {
            if decode[..i].contains(url) {
                return Err(EngineError::arg(
                    "--decode",
                    format!("{url} is given twice"),
                ));
            }
        }
        for (i, p) in prefill.iter().enumerate() {
            if prefill[..i].iter().any(|q| q.url == p.url) {
                return Err(EngineError::arg(
                    "--prefill",
                    format!("{} is given twice", p.url),
                ));
            }
        }
        if !self.worker_kv_events.is_empty() {
            return Err(EngineError::arg(
                "--worker-kv-events",
                "the PD router does not read KV events",
            ));
        }
        Ok(RouterConfig {
            workers: Vec::new(),
            kv_events: Vec::new(),
            kv_events_topic: String::new(),
            policy: self.policy,
            cache_aware,
            health,
            prefill,
            decode,
            prefill_policy,
            decode_policy,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: Duration::from_secs(self.request_timeout_secs),
            tokenizer: self.tokenizer(),
        })
    }
}

impl RouterArgs {
    /// `--worker-kv-events` and `--worker-kv-events-replay`, checked against the policy and
    /// the number of workers.
    fn kv_events(&self, policy: PolicyKind, workers: usize) -> Result<Vec<EventSource>> {
        let flag = "--worker-kv-events";
        let given = &self.worker_kv_events;
        let replay = &self.worker_kv_events_replay;
        if policy != PolicyKind::KvEvents {
            if !given.is_empty() || !replay.is_empty() {
                return Err(EngineError::arg(
                    if given.is_empty() {
                        "--worker-kv-events-replay"
                    } else {
                        flag
                    },
                    "only the kv_events policy reads KV events",
                ));
            }
            return Ok(Vec::new());
        }
        if given.len() != workers {
            return Err(EngineError::arg(
                flag,
                format!(
                    "--policy kv_events needs one endpoint per worker: {} for {workers} workers",
                    given.len()
                ),
            ));
        }
        if !replay.is_empty() && replay.len() != workers {
            return Err(EngineError::arg(
                "--worker-kv-events-replay",
                format!(
                    "one replay endpoint per worker, or none: {} for {workers} workers",
                    replay.len()
                ),
            ));
        }
        for e in given {
            check_endpoint(e).map_err(|m| EngineError::arg(flag, m))?;
        }
        for e in replay {
            check_endpoint(e).map_err(|m| EngineError::arg("--worker-kv-events-replay", m))?;
        }
        Ok(given
            .iter()
            .enumerate()
            .map(|(i, e)| EventSource {
                endpoint: e.clone(),
                replay: replay.get(i).cloned(),
            })
            .collect())
    }

    /// `cache_aware`'s settings, checked.
    fn cache_aware(&self) -> Result<CacheAwareConfig> {
        CacheAwareConfig {
            cache_threshold: self.cache_threshold,
            balance_abs_threshold: self.balance_abs_threshold,
            balance_rel_threshold: self.balance_rel_threshold,
            eviction_interval_secs: self.eviction_interval,
            max_tree_size: self.max_tree_size,
        }
        .checked()
    }
}

/// Splits the values of every `--prefill` back into `[URL]` / `[URL, PORT]` occurrences: a
/// URL has `://`, a port follows its URL.
fn group_prefill(values: &[String]) -> Result<Vec<Vec<String>>> {
    let mut groups: Vec<Vec<String>> = Vec::new();
    for v in values {
        match groups.last_mut() {
            Some(g) if g.len() == 1 && !v.contains("://") => g.push(v.clone()),
            Some(_) if !v.contains("://") => {
                return Err(EngineError::arg(
                    "--prefill",
                    format!(
                        "{v:?} is not a URL and follows a bootstrap port; expected \
                             --prefill URL [BOOTSTRAP_PORT]"
                    ),
                ))
            }
            _ => groups.push(vec![v.clone()]),
        }
    }
    Ok(groups)
}

/// One `--prefill URL [BOOTSTRAP_PORT]` occurrence.
fn parse_prefill(values: &[String]) -> Result<PrefillWorker> {
    let flag = "--prefill";
    let (url, port) = match values {
        [url] => (url, None),
        [url, port] => (url, Some(port)),
        _ => return Err(EngineError::arg(flag, "expected URL [BOOTSTRAP_PORT]")),
    };
    let url = WorkerUrl::parse(url).map_err(|m| EngineError::arg(flag, m))?;
    let bootstrap_port = match port {
        None => DEFAULT_BOOTSTRAP_PORT,
        Some(p) => match p.trim().parse::<u16>() {
            Ok(0) | Err(_) => {
                return Err(EngineError::arg(
                    flag,
                    format!("{url}: bootstrap port {p:?} is not a port number (1-65535)"),
                ))
            }
            Ok(p) => p,
        },
    };
    Ok(PrefillWorker {
        url,
        bootstrap_port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_urls_need_an_http_scheme_and_a_host() {
        let u = WorkerUrl::parse("http://10.0.0.1:30000/").unwrap();
        assert_eq!((u.base(), u.host()), ("http://10.0.0.1:30000", "10.0.0.1"));
        assert_eq!(u.join("/generate"), "http://10.0.0.1:30000/generate");
        let v6 = WorkerUrl::parse("http://[::1]:8000").unwrap();
        assert_eq!(v6.host(), "[::1]");
        for bad in [
            "10.0.0.1:30000",
            "http://:8000",
            "https://a:1",
            "http://a:1/?x=1",
            "",
        ] {
            assert!(WorkerUrl::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn prefill_values_group_into_urls_and_their_ports() {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let g =
            group_prefill(&v(&["http://a:1", "9000", "http://b:2", "http://c:3", "9"])).unwrap();
        assert_eq!(
            g,
            [
                v(&["http://a:1", "9000"]),
                v(&["http://b:2"]),
                v(&["http://c:3", "9"])
            ]
        );
        assert!(group_prefill(&v(&["http://a:1", "1", "2"])).is_err());
        // A first value without a scheme is a URL, refused by parse_prefill.
        assert_eq!(group_prefill(&v(&["a:1"])).unwrap(), [v(&["a:1"])]);
    }

    #[test]
    fn bootstrap_ports_default_to_8998_and_must_be_ports() {
        let p = parse_prefill(&["http://a:1".into()]).unwrap();
        assert_eq!(p.bootstrap_port, DEFAULT_BOOTSTRAP_PORT);
        let p = parse_prefill(&["http://a:1".into(), "9000".into()]).unwrap();
        assert_eq!(p.bootstrap_port, 9000);
        for bad in ["0", "70000", "none"] {
            let e = parse_prefill(&["http://a:1".into(), bad.into()]).unwrap_err();
            assert!(
                e.to_string()
                    .starts_with("--prefill: http://a:1: bootstrap port"),
                "{e}"
            );
        }
    }
}
