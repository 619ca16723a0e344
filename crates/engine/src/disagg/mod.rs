//! PD disaggregation in the engine: the server roles (SGLang's `--disaggregation-mode`) and
//! what a request carries to find its peer (`bootstrap_host`, `bootstrap_port`,
//! `bootstrap_room`, chosen by the router).

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

mod decode;
mod prefill;
mod setup;

pub use decode::DecodeSide;
pub use prefill::PrefillSide;
pub use setup::{build_pd_side, LocalKv, PdOptions};

use scheduler::{FinishedReq, ReqId, Scheduler};

use crate::engine_loop::{LiveMap, Submission};
use crate::setup::ModelExecutor;

/// A prefill or decode server's PD half of the engine loop: it takes the requests that carry
/// bootstrap fields, moves them through SGLang's PD queues around the scheduler's steps, and
/// owns the transfer runtime (dropped after the manager).
pub enum PdSide {
    /// `--disaggregation-mode prefill`.
    Prefill(PrefillSide),
    /// `--disaggregation-mode decode`.
    Decode(DecodeSide),
}

impl PdSide {
    /// Takes a request with bootstrap fields (its pair's room).
    pub(crate) fn submit(&mut self, s: &mut Scheduler, sub: Submission) {
        match self {
            PdSide::Prefill(p) => p.submit(sub),
            PdSide::Decode(d) => d.submit(s, sub),
        }
    }

    /// Whether requests wait on PD peers (the loop then polls instead of sleeping).
    pub fn has_work(&self) -> bool {
        match self {
            PdSide::Prefill(p) => p.has_work(),
            PdSide::Decode(d) => d.has_work(),
        }
    }

    /// Moves requests along the PD queues before a step: handshakes that completed enter the
    /// scheduler, transfers that ended commit or fail.
    pub(crate) fn before_step(
        &mut self,
        s: &mut Scheduler,
        exec: &mut ModelExecutor,
        live: &mut LiveMap,
    ) {
        match self {
            PdSide::Prefill(p) => p.before_step(s, exec, live),
            PdSide::Decode(d) => d.before_step(s, exec, live),
        }
    }

    /// Aborts request `id` if it is in a PD queue (`true`: taken care of; its KV is freed once
    /// no transfer can touch it any more).
    pub(crate) fn abort(&mut self, s: &mut Scheduler, id: ReqId, why: &str) -> bool {
        match self {
            PdSide::Prefill(p) => p.abort(s, id, why),
            PdSide::Decode(d) => d.abort(s, id, why),
        }
    }

    /// Keeps a finished request whose KV is still being sent (`true`); it is finished later by
    /// [`after_step`](Self::after_step).
    pub(crate) fn hold(&mut self, s: &mut Scheduler, f: &FinishedReq) -> bool {
        match self {
            PdSide::Prefill(p) => p.hold(s, f),
            PdSide::Decode(_) => false,
        }
    }

    /// After a step: sends the pages that became ready and returns the held requests whose
    /// transfer ended.
    pub(crate) fn after_step(&mut self, s: &mut Scheduler) -> Vec<FinishedReq> {
        match self {
            PdSide::Prefill(p) => p.after_step(s),
            PdSide::Decode(d) => d.after_step(s),
        }
    }

    /// Whether tokens reach clients only at the end: a prefill server answers once its
    /// request's KV has been delivered (or has failed), as SGLang's.
    pub fn answers_at_the_end(&self) -> bool {
        matches!(self, PdSide::Prefill(_))
    }

    /// Ends every PD request (the server is stopping).
    pub(crate) fn shutdown(&mut self, s: &mut Scheduler) {
        match self {
            PdSide::Prefill(p) => p.shutdown(s),
            PdSide::Decode(d) => d.shutdown(s),
        }
    }

    /// The queue gauges and transfer counters for `/metrics`.
    pub fn metrics(&self, s: &Scheduler) -> crate::engine_metrics::PdMetrics {
        match self {
            PdSide::Prefill(p) => p.metrics(),
            PdSide::Decode(d) => d.metrics(s),
        }
    }

    /// The PD queues and transfer counters (for `/get_server_info`).
    pub fn info(&self, s: &Scheduler) -> serde_json::Value {
        match self {
            PdSide::Prefill(p) => p.info(s),
            PdSide::Decode(d) => d.info(s),
        }
    }
}
