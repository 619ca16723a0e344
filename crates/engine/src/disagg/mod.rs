//! PD disaggregation in the engine: the server roles (SGLang's `--disaggregation-mode`), what
//! a request carries to find its peer (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`,
//! chosen by the router), and [`KvHostMirror`], the host memory a PD server on a device backend
//! gives its transfer engine in place of the device store.

use std::fmt;

use crate::error::{EngineError, Result};

/// How the message of a request that failed because its KV did not arrive (or could not be
/// sent) begins: its client gets an error (HTTP 500, SGLang's status for a `KVTransferError`)
/// rather than an empty completion.
pub const TRANSFER_FAILED: &str = "KV transfer failed";

/// SGLang's `--disaggregation-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DisaggregationMode {
    /// One server does prefill and decode.
    #[default]
    Null,
    /// Prefill only: each request computes its prompt and first token, and its KV is sent to
    /// the decode server the router paired it with.
    Prefill,
    /// Decode only: each request's KV arrives from a prefill server, then it decodes.
    Decode,
}

impl DisaggregationMode {
    /// The flag's values.
    pub const NAMES: [&'static str; 3] = ["null", "prefill", "decode"];

    /// Parses `--disaggregation-mode`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "null" => Ok(DisaggregationMode::Null),
            "prefill" => Ok(DisaggregationMode::Prefill),
            "decode" => Ok(DisaggregationMode::Decode),
            other => Err(EngineError::arg(
                "--disaggregation-mode",
                format!("`{other}` is not one of null, prefill, decode"),
            )),
        }
    }

    /// The flag value.
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// Whether requests must carry bootstrap fields.
    pub fn is_disaggregated(self) -> bool {
        self != DisaggregationMode::Null
    }
}

impl fmt::Display for DisaggregationMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a request's prefill server bootstraps, and the room that pairs its two halves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    /// The prefill server's host (the router takes it from the prefill URL).
    pub host: String,
    /// The prefill server's `--disaggregation-bootstrap-port`.
    pub port: u16,
    /// The router's random id of the pair.
    pub room: u64,
}

impl Bootstrap {
    /// `host:port` of the bootstrap server (IPv6 hosts bracketed).
    pub fn addr(&self) -> String {
        if self.host.contains(':') && !self.host.starts_with('[') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

mod host_mirror;
mod options;

pub use host_mirror::KvHostMirror;
pub use options::{LocalKv, PdOptions};
