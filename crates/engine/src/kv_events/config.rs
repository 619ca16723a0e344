//! `--kv-events-config`: vLLM's `KVEventsConfig` (SGLang's flag of the same name), parsed from
//! JSON with vLLM's key names and defaults, every value checked.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::KvEventsError;

/// Which publisher carries the events (vLLM's `publisher`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PublisherKind {
    /// Nothing is published (the cache does not even record events).
    Null,
    /// vLLM's `ZmqEventPublisher`: a PUB socket, and a ROUTER socket for replay.
    Zmq,
}

/// vLLM's `KVEventsConfig`. Unknown keys are refused.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// vLLM's switch; `false` publishes nothing whatever `publisher` says. When `publisher` is
    /// left out it picks it, as vLLM: `zmq` when true, `null` otherwise (SGLang's default).
    pub enable_kv_cache_events: Option<bool>,
    pub publisher: Option<PublisherKind>,
    /// Where the PUB socket binds: `tcp://HOST:PORT`, `*` for every interface, port 0 for any
    /// free port (the bound one is shown by `/get_server_info`).
    pub endpoint: String,
    /// Where the replay ROUTER socket binds (none: no replay).
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// vLLM's socket high-water mark. Accepted for compatibility; the pure-Rust socket has a
    /// fixed per-subscriber queue and drops for slow subscribers as a PUB socket does.
    pub hwm: usize,
    /// Batches waiting for the publisher thread at most; a batch that finds the queue full is
    /// dropped (its sequence number is skipped: subscribers see a gap).
    pub max_queue_size: usize,
    /// The first frame of every message (subscribers filter on it).
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enable_kv_cache_events: None,
            publisher: None,
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// Parses and checks the flag's JSON.
    pub fn from_arg(text: &str) -> Result<Self, KvEventsError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let cfg: KvEventsConfig = serde_path_to_error::deserialize(de)
            .map_err(|e| KvEventsError::Config(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The publisher in effect (see [`KvEventsConfig::enable_kv_cache_events`]).
    pub fn publisher_kind(&self) -> PublisherKind {
        match (self.enable_kv_cache_events, self.publisher) {
            (Some(false), _) => PublisherKind::Null,
            (_, Some(p)) => p,
            (Some(true), None) => PublisherKind::Zmq,
            (None, None) => PublisherKind::Null,
        }
    }

    fn validate(&self) -> Result<(), KvEventsError> {
        let endpoint = TcpEndpoint::parse("endpoint", &self.endpoint)?;
        if let Some(r) = &self.replay_endpoint {
            let replay = TcpEndpoint::parse("replay_endpoint", r)?;
            if replay.port != 0 && replay == endpoint {
                return Err(KvEventsError::Config(format!(
                    "replay_endpoint: {r} is also the endpoint; give each socket its own port"
                )));
            }
        }
        if self.max_queue_size == 0 {
            return Err(KvEventsError::Config(
                "max_queue_size: must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// A checked `tcp://HOST:PORT` endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpEndpoint {
    /// `*` is kept as `0.0.0.0` (every IPv4 interface).
    pub host: String,
    pub port: u16,
}

impl TcpEndpoint {
    /// Parses `text` (the value of config key `key`).
    pub fn parse(key: &str, text: &str) -> Result<Self, KvEventsError> {
        let bad = |why: &str| KvEventsError::Config(format!("{key}: {text:?} {why}"));
        let rest = text
            .strip_prefix("tcp://")
            .ok_or_else(|| bad("is not a tcp://HOST:PORT endpoint (only tcp is supported)"))?;
        let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("has no :PORT"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| bad("has no valid port (0 to 65535)"))?;
        let host = match host {
            "" => return Err(bad("has no host (use * for every interface)")),
            "*" => "0.0.0.0".to_string(),
            h if h.contains(['/', ' ']) => return Err(bad("has an invalid host")),
            h => h.to_string(),
        };
        Ok(TcpEndpoint { host, port })
    }
}

impl fmt::Display for TcpEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tcp://{}:{}", self.host, self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_vllms() {
        let c = KvEventsConfig::from_arg("{}").unwrap();
        assert_eq!(c, KvEventsConfig::default());
        assert_eq!(c.publisher_kind(), PublisherKind::Null);
        assert_eq!(
            (c.buffer_steps, c.hwm, c.max_queue_size),
            (10_000, 100_000, 100_000)
        );
        let c = KvEventsConfig::from_arg(
            r#"{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events",
                "replay_endpoint": "tcp://127.0.0.1:5558"}"#,
        )
        .unwrap();
        assert_eq!(c.publisher_kind(), PublisherKind::Zmq);
        assert_eq!(
            TcpEndpoint::parse("endpoint", &c.endpoint)
                .unwrap()
                .to_string(),
            "tcp://0.0.0.0:5557"
        );
        let vllm = KvEventsConfig::from_arg(r#"{"enable_kv_cache_events": true}"#).unwrap();
        assert_eq!(vllm.publisher_kind(), PublisherKind::Zmq);
        let off =
            KvEventsConfig::from_arg(r#"{"enable_kv_cache_events": false, "publisher": "zmq"}"#)
                .unwrap();
        assert_eq!(off.publisher_kind(), PublisherKind::Null);
    }

    #[test]
    fn bad_values_are_errors_naming_the_key() {
        for (json, want) in [
            (
                r#"{"publisher": "kafka"}"#,
                "publisher: unknown variant `kafka`",
            ),
            (r#"{"bogus": 1}"#, "unknown field `bogus`"),
            (r#"{"buffer_steps": -1}"#, "buffer_steps: invalid value"),
            (
                r#"{"endpoint": "ipc:///tmp/x"}"#,
                "endpoint: \"ipc:///tmp/x\" is not",
            ),
            (r#"{"endpoint": "tcp://*"}"#, "has no :PORT"),
            (r#"{"endpoint": "tcp://*:99999"}"#, "no valid port"),
            (r#"{"endpoint": "tcp://:5"}"#, "has no host"),
            (
                r#"{"max_queue_size": 0}"#,
                "max_queue_size: must be at least 1",
            ),
            (
                r#"{"replay_endpoint": "tcp://*:5557"}"#,
                "replay_endpoint: tcp://*:5557 is also the endpoint",
            ),
            ("not json", "expected"),
        ] {
            let e = KvEventsConfig::from_arg(json).unwrap_err().to_string();
            assert!(e.contains(want), "{json}: {e}");
        }
    }
}
