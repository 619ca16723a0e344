//! `kvserve router`'s flags ([`RouterArgs`], named as SGLang's `sglang_router.launch_router`)
//! and their validated form ([`RouterConfig`]): the prefill workers with their bootstrap
//! ports, the decode workers, the selection policies and the timeouts.
//!
//! A worker URL must be `http://HOST[:PORT][/PATH]` with a host: the router's client speaks
//! plain HTTP, and the host is what it tells the decode server to bootstrap from.

use std::time::Duration;

use clap::{ArgAction, Args, ValueEnum};
use reqwest::Url;

use crate::error::{EngineError, Result};

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
}

impl PolicyKind {
    /// The name as the command line and `/get_server_info` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Random => "random",
            PolicyKind::RoundRobin => "round_robin",
        }
    }
}

/// Flags of `kvserve router` (SGLang's `launch_router` names and defaults).
#[derive(Debug, Clone, Args)]
pub struct RouterArgs {
    /// Prefill-decode disaggregation: each request goes to a prefill and a decode server at
    /// once (the only mode this router implements; the flag is required, as SGLang's).
    #[arg(long)]
    pub pd_disaggregation: bool,
    /// A prefill server: its URL and, optionally, its bootstrap port (default 8998).
    /// Repeat for several prefill servers. (The values of all occurrences, in order: a value
    /// without `://` is the bootstrap port of the URL before it.)
    #[arg(long, value_names = ["URL", "BOOTSTRAP_PORT"], num_args = 1..=2, action = ArgAction::Append, required = true)]
    pub prefill: Vec<String>,
    /// A decode server's URL. Repeat for several decode servers.
    #[arg(long, value_name = "URL", action = ArgAction::Append, required = true)]
    pub decode: Vec<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// How prefill and decode workers are picked.
    #[arg(long, value_enum, default_value_t = PolicyKind::Random)]
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

/// The router's validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    /// At least one prefill server.
    pub prefill: Vec<PrefillWorker>,
    /// At least one decode server.
    pub decode: Vec<WorkerUrl>,
    /// How prefill workers are picked.
    pub prefill_policy: PolicyKind,
    /// How decode workers are picked.
    pub decode_policy: PolicyKind,
    /// Longest wait for a TCP connection to a worker.
    pub connect_timeout: Duration,
    /// Longest wait for the next bytes of a worker's response.
    pub request_timeout: Duration,
}

impl RouterConfig {
    /// One prefill and one decode worker (bootstrap port [`DEFAULT_BOOTSTRAP_PORT`]), both
    /// policies random, the default timeouts.
    pub fn new(prefill: &str, decode: &str) -> Result<Self> {
        Ok(RouterConfig {
            prefill: vec![PrefillWorker {
                url: WorkerUrl::parse(prefill).map_err(|m| EngineError::arg("--prefill", m))?,
                bootstrap_port: DEFAULT_BOOTSTRAP_PORT,
            }],
            decode: vec![WorkerUrl::parse(decode).map_err(|m| EngineError::arg("--decode", m))?],
            prefill_policy: PolicyKind::Random,
            decode_policy: PolicyKind::Random,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: Duration::from_secs(1800),
        })
    }
}

impl RouterArgs {
    /// The validated configuration; errors name the flag.
    pub fn config(&self) -> Result<RouterConfig> {
        if !self.pd_disaggregation {
            return Err(EngineError::arg(
                "--pd-disaggregation",
                "this router implements only prefill-decode disaggregation: pass \
                 --pd-disaggregation with --prefill URL [BOOTSTRAP_PORT] and --decode URL",
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
        Ok(RouterConfig {
            prefill,
            decode,
            prefill_policy: self.prefill_policy.unwrap_or(self.policy),
            decode_policy: self.decode_policy.unwrap_or(self.policy),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: Duration::from_secs(self.request_timeout_secs),
        })
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
