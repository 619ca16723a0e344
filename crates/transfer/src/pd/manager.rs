//! [`KvManager`]: one per server (SGLang's `KVManager`, `disaggregation/common/conn.py`). It owns
//! the rooms' state, the background tasks (prefill: bootstrap server, control listener, one task
//! per decode connection, one transfer worker per sending room; decode: one connection, reader
//! and heartbeat per prefill server) and the timeout reaper. Dropping the last clone (or
//! [`KvManager::shutdown`]) stops every task and fails every live room.
//!
//! Locking: one `std::sync::Mutex` over the shared [`State`](crate::pd::state::State), never held across an `.await`; the engine
//! thread's calls (`poll`, `send`, …) only take it and push messages into channels.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_pool::MemoryRegion;
use tokio::sync::watch;

use crate::engine::{RegionId, TransferEngine};
use crate::pd::bootstrap::{self, BootstrapServer, RankRegistration};
use crate::pd::config::{PdConfig, PdRole, PdStats, ServerCompat};
use crate::pd::error::PdError;
use crate::pd::kv_poll::KvPoll;
use crate::pd::receiver::KvReceiver;
use crate::pd::sender::KvSender;
use crate::pd::state::{Shared, State};
use crate::pd::{decode, log, prefill};

#[derive(Debug)]
struct Handle {
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    bootstrap: Option<BootstrapServer>,
}

impl Handle {
    fn stop(&self) {
        self.shutdown.send_replace(true);
        if let Some(b) = &self.bootstrap {
            b.stop();
        }
        let mut st = self.shared.lock();
        let live: Vec<u64> = st.rooms.keys().copied().collect();
        for room in live {
            st.transition(
                room,
                KvPoll::Failed,
                Some("the PD manager shut down".into()),
            );
        }
        for (_, peer) in st.peers.drain() {
            for t in peer.tasks {
                t.abort();
            }
        }
        st.conns.clear();
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One server's PD transfer manager (SGLang's `KVManager`); cheap to clone.
#[doc(alias = "KVManager")]
#[derive(Debug, Clone)]
pub struct KvManager {
    handle: Arc<Handle>,
}

impl KvManager {
    /// Starts the manager on `rt`: a prefill binds its bootstrap server on
    /// `cfg.bootstrap_host:cfg.bootstrap_port` and a control listener on the same host (any
    /// port), and registers itself (5 attempts, backoff 1 s → 30 s); a decode starts idle and
    /// connects to prefill servers as receivers name them. `local` are this server's KV regions
    /// as registered with `engine` (ids from `register`), in layer/buffer order (both sides'
    /// orders agree when their [`ServerCompat`] does). `compat.regions` must be `local.len()`.
    pub fn start(
        cfg: PdConfig,
        compat: ServerCompat,
        engine: Arc<dyn TransferEngine>,
        local: Vec<(RegionId, MemoryRegion)>,
        rt: tokio::runtime::Handle,
    ) -> Result<KvManager, PdError> {
        if compat.regions as usize != local.len() {
            return Err(PdError::Invalid(format!(
                "ServerCompat.regions is {} but {} regions were given",
                compat.regions,
                local.len()
            )));
        }
        if compat.transfer_backend != engine.kind() {
            return Err(PdError::Invalid(format!(
                "ServerCompat.transfer_backend is {} but the engine is {}",
                compat.transfer_backend,
                engine.kind()
            )));
        }
        let (tx, rx) = watch::channel(false);
        let http = bootstrap::http_client(cfg.bootstrap_timeout.min(Duration::from_secs(30)))?;
        let heartbeat_http =
            bootstrap::http_client(cfg.heartbeat_interval.max(Duration::from_millis(20)))?;
        let shared = Arc::new(Shared {
            cfg,
            compat,
            engine,
            local,
            rt: rt.clone(),
            http,
            heartbeat_http,
            shutdown: rx,
            state: Mutex::new(State::default()),
        });
        let mut bootstrap_server = None;
        if shared.cfg.role == PdRole::Prefill {
            let server =
                BootstrapServer::start(&shared.cfg.bootstrap_host, shared.cfg.bootstrap_port, &rt)?;
            let control = prefill::start_listener(&shared)?;
            let reg = RankRegistration {
                role: "Prefill".into(),
                rank_ip: bootstrap::advertised(&shared.cfg.bootstrap_host),
                rank_port: control.port(),
                engine_rank: 0,
                compat: shared.compat.clone(),
            };
            let addr = server.addr();
            let addr = SocketAddr::new(
                bootstrap::advertised(&addr.ip().to_string())
                    .parse()
                    .unwrap_or(addr.ip()),
                addr.port(),
            );
            rt.spawn(async move {
                if let Err(e) =
                    bootstrap::register_rank(addr, &reg, 5, Duration::from_secs(1)).await
                {
                    log(format_args!("prefill registration failed: {e}"));
                }
            });
            bootstrap_server = Some(server);
        }
        let reaper = shared.clone();
        rt.spawn(async move {
            let every = reaper.cfg.reap_interval();
            let stop = Shared::stopped(reaper.shutdown.clone());
            tokio::pin!(stop);
            loop {
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tokio::time::sleep(every) => {}
                }
                match reaper.cfg.role {
                    PdRole::Prefill => prefill::reap(&reaper),
                    PdRole::Decode => decode::reap(&reaper),
                }
            }
        });
        Ok(KvManager {
            handle: Arc::new(Handle {
                shared,
                shutdown: tx,
                bootstrap: bootstrap_server,
            }),
        })
    }

    /// Prefill: where the bootstrap server listens (`None` on decode).
    pub fn bootstrap_addr(&self) -> Option<SocketAddr> {
        self.handle.bootstrap.as_ref().map(|b| b.addr())
    }

    /// This manager's role.
    pub fn role(&self) -> PdRole {
        self.handle.shared.cfg.role
    }

    /// Prefill: a sender for `room` (`Bootstrapping` until decode's TransferInfo arrives; one
    /// that arrived earlier is used at once). A room that is still live is
    /// [`PdError::DuplicateRoom`].
    pub fn create_sender(&self, room: u64) -> Result<KvSender, PdError> {
        let shared = &self.handle.shared;
        if shared.cfg.role != PdRole::Prefill {
            return Err(PdError::WrongRole {
                call: "create_sender",
                role: "prefill",
            });
        }
        prefill::create_room(shared, room)?;
        Ok(KvSender::new(room, shared.clone()))
    }

    /// Decode: a receiver for `room`, whose KV the prefill server bootstrapped at `bootstrap`
    /// (`host:port`) computes. The first receiver for an address fetches its server info,
    /// checks [`ServerCompat`] and connects; later ones reuse the connection.
    pub fn create_receiver(&self, room: u64, bootstrap: &str) -> Result<KvReceiver, PdError> {
        let shared = &self.handle.shared;
        if shared.cfg.role != PdRole::Decode {
            return Err(PdError::WrongRole {
                call: "create_receiver",
                role: "decode",
            });
        }
        decode::create_room(shared, room, bootstrap)?;
        Ok(KvReceiver::new(room, shared.clone()))
    }

    /// Per-state counts of live rooms and the totals.
    pub fn stats(&self) -> PdStats {
        let st = self.handle.shared.lock();
        let mut s = PdStats {
            success_total: st.success_total,
            failed_total: st.failed_total,
            bytes: st.bytes,
            transfer_seconds: st.transfer_seconds,
            pending_infos: st.pending.len(),
            peers: st.peers.values().filter(|p| p.tx.is_some()).count(),
            ..PdStats::default()
        };
        for r in st.rooms.values() {
            match r.cell.get() {
                KvPoll::Bootstrapping => s.bootstrapping += 1,
                KvPoll::WaitingForInput => s.waiting_for_input += 1,
                KvPoll::Transferring => s.transferring += 1,
                _ => {}
            }
        }
        s
    }

    /// Prefill: stops the bootstrap server only (it stops answering `/route` and `/health`);
    /// live transfers go on. For graceful shutdown and tests of decode's heartbeats.
    pub fn stop_bootstrap_server(&self) {
        if let Some(b) = &self.handle.bootstrap {
            b.stop();
        }
    }

    /// Stops every task now and fails every live room (as dropping the last clone does).
    pub fn shutdown(&self) {
        self.handle.stop();
    }
}
