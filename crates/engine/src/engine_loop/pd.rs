//! The engine loop's PD half on a prefill or decode server: [`PdSide`] takes the requests that
//! carry bootstrap fields through SGLang's PD queues around the scheduler's steps
//! (`prefill`: bootstrap → scheduler → inflight; `decode`: handshake → preallocation → transfer
//! → running), and `build` makes it from the server's [`PdOptions`](crate::disagg::PdOptions).

mod build;
mod decode;
mod prefill;

pub use build::build_pd_side;
pub use decode::DecodeSide;
pub use prefill::PrefillSide;

use scheduler::{FinishedReq, ReqId, Scheduler};

use super::{LiveMap, Submission};
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
    pub(crate) fn after_step(
        &mut self,
        s: &mut Scheduler,
        exec: &mut ModelExecutor,
    ) -> Vec<FinishedReq> {
        match self {
            PdSide::Prefill(p) => p.after_step(s, exec),
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
