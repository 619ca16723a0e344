//! The protocol's plain values: [`PdConfig`] (SGLang's defaults), [`ServerCompat`] (what must
//! match between a prefill and a decode server), [`TransferAux`] (SGLang's metadata row),
//! [`TransferInfo`] and [`PdStats`].

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::engine::BackendKind;
use crate::pd::error::PdError;

/// Which side of the disaggregation a server is (SGLang's `DisaggregationMode`, less `null`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PdRole {
    /// Computes prompts' KV and sends it (`KVSender`s, the bootstrap server).
    Prefill,
    /// Receives KV and decodes (`KVReceiver`s).
    Decode,
}

/// A [`KvManager`](crate::pd::KvManager)'s settings; [`PdConfig::new`] gives SGLang's defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdConfig {
    /// Which side this manager serves.
    pub role: PdRole,
    /// Prefill: the address the bootstrap server and the control listener bind and advertise
    /// (a wildcard is advertised as 127.0.0.1, as SGLang). Default `127.0.0.1`.
    pub bootstrap_host: String,
    /// Prefill: the bootstrap server's port (SGLang's `--disaggregation-bootstrap-port`, default
    /// 8998); 0 picks a free one (tests).
    pub bootstrap_port: u16,
    /// A room that stays `Bootstrapping` longer fails (SGLang's
    /// `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`, 300 s). Also how long prefill keeps a
    /// TransferInfo for a room it has not created yet.
    pub bootstrap_timeout: Duration,
    /// Decode: a room `WaitingForInput` or `Transferring` longer than this (counted from the
    /// handshake) fails and aborts its prefill (SGLang's `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`,
    /// 300 s).
    pub waiting_timeout: Duration,
    /// Decode: how often each prefill's `/health` is asked (SGLang's
    /// `SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL`, 5 s); also that request's timeout.
    pub heartbeat_interval: Duration,
    /// Decode: consecutive missed heartbeats that fail every room of that prefill (SGLang's
    /// `SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`, 2).
    pub heartbeat_max_failures: u32,
}

impl PdConfig {
    /// SGLang's defaults for `role`.
    pub fn new(role: PdRole) -> Self {
        PdConfig {
            role,
            bootstrap_host: "127.0.0.1".into(),
            bootstrap_port: 8998,
            bootstrap_timeout: Duration::from_secs(300),
            waiting_timeout: Duration::from_secs(300),
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_max_failures: 2,
        }
    }

    /// How often the timeout reaper runs: a quarter of the shortest deadline, within 5 ms..1 s.
    pub(crate) fn reap_interval(&self) -> Duration {
        let shortest = self.bootstrap_timeout.min(self.waiting_timeout);
        (shortest / 4).clamp(Duration::from_millis(5), Duration::from_secs(1))
    }
}

/// What must be equal on a prefill and a decode server for pages to be copied byte for byte
/// (SGLang checks page size and KV dtype at start-up; we check the whole layout's fingerprint).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerCompat {
    /// The served model's name.
    pub model: String,
    /// Tokens per page.
    pub page_size: u32,
    /// The KV store's dtype name (`bfloat16`, `fp8_e4m3` …).
    pub kv_dtype: String,
    /// Bytes of one page over all layers and buffers (`KvLayout::page_bytes`).
    pub page_bytes: u64,
    /// Registered KV regions (layers × buffers).
    pub regions: u32,
    /// The transfer backend.
    pub transfer_backend: BackendKind,
}

impl ServerCompat {
    /// `Ok` when `theirs` (the prefill's, seen from decode) equals `self` field by field; else
    /// [`PdError::Incompatible`] naming the first field that differs, in declaration order.
    pub fn check(&self, theirs: &ServerCompat) -> Result<(), PdError> {
        let fields: [(&'static str, String, String); 6] = [
            ("model", self.model.clone(), theirs.model.clone()),
            (
                "page_size",
                self.page_size.to_string(),
                theirs.page_size.to_string(),
            ),
            ("kv_dtype", self.kv_dtype.clone(), theirs.kv_dtype.clone()),
            (
                "page_bytes",
                self.page_bytes.to_string(),
                theirs.page_bytes.to_string(),
            ),
            (
                "regions",
                self.regions.to_string(),
                theirs.regions.to_string(),
            ),
            (
                "transfer_backend",
                self.transfer_backend.to_string(),
                theirs.transfer_backend.to_string(),
            ),
        ];
        for (field, ours, theirs) in fields {
            if ours != theirs {
                return Err(PdError::Incompatible {
                    field,
                    ours,
                    theirs,
                });
            }
        }
        Ok(())
    }
}

/// What travels with the last chunk besides the pages (SGLang's metadata-buffer row).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferAux {
    /// The prefill's output token(s): decode's first output.
    pub first_token_ids: Vec<u32>,
    /// Prompt tokens the prefill found in its cache (reported to the client).
    pub cached_tokens: usize,
    /// The room, checked by decode (SGLang's guard against a metadata row of another request).
    pub bootstrap_room: u64,
}

/// What the decode side asked for, as the prefill sees it (SGLang's `TransferInfo`, reduced).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferInfo {
    /// Prompt positions decode already holds (page-aligned): the sender starts there.
    pub decode_prefix_len: usize,
    /// Destination pages: the sender must send exactly this many, in order.
    pub num_pages: usize,
}

/// A manager's counters (for `/get_server_info` and `/metrics`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PdStats {
    /// Live rooms `Bootstrapping`.
    pub bootstrapping: usize,
    /// Live rooms `WaitingForInput`.
    pub waiting_for_input: usize,
    /// Live rooms `Transferring`.
    pub transferring: usize,
    /// Rooms that reached `Success`, ever.
    pub success_total: u64,
    /// Rooms that reached `Failed`, ever.
    pub failed_total: u64,
    /// KV bytes moved by successful transfers (sent on prefill, received on decode).
    pub bytes: u64,
    /// Seconds spent transferring, summed over successful rooms (prefill: first submit to the
    /// last batch done; decode: `send_metadata` to `Success`).
    pub transfer_seconds: f64,
    /// Prefill: TransferInfo messages kept for rooms not created yet.
    pub pending_infos: usize,
    /// Decode: prefill servers connected.
    pub peers: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_check_names_the_first_differing_field() {
        let ours = ServerCompat {
            model: "m".into(),
            page_size: 16,
            kv_dtype: "bfloat16".into(),
            page_bytes: 4096,
            regions: 8,
            transfer_backend: BackendKind::Tcp,
        };
        assert_eq!(ours.check(&ours), Ok(()));
        type Change = fn(&mut ServerCompat);
        let cases: [(&str, Change); 6] = [
            ("model", |c| c.model = "other".into()),
            ("page_size", |c| c.page_size = 1),
            ("kv_dtype", |c| c.kv_dtype = "float16".into()),
            ("page_bytes", |c| c.page_bytes = 1),
            ("regions", |c| c.regions = 1),
            ("transfer_backend", |c| {
                c.transfer_backend = BackendKind::Shm
            }),
        ];
        for (name, change) in cases {
            let mut theirs = ours.clone();
            change(&mut theirs);
            // A later field differing too does not hide the first.
            theirs.transfer_backend = BackendKind::Nixl;
            match ours.check(&theirs) {
                Err(PdError::Incompatible { field, .. }) => assert_eq!(field, name),
                other => panic!("{other:?}"),
            }
        }
        let err = ours
            .check(&ServerCompat {
                page_size: 1,
                ..ours.clone()
            })
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "incompatible prefill server: page_size is 1 there but 16 here"
        );
    }

    #[test]
    fn defaults_are_sglangs() {
        let c = PdConfig::new(PdRole::Decode);
        assert_eq!(c.bootstrap_port, 8998);
        assert_eq!(c.bootstrap_timeout, Duration::from_secs(300));
        assert_eq!(c.waiting_timeout, Duration::from_secs(300));
        assert_eq!(c.heartbeat_interval, Duration::from_secs(5));
        assert_eq!(c.heartbeat_max_failures, 2);
    }
}
