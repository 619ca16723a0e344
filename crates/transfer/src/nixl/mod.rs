//! The `nixl` backend: [`TransferEngine`] over NVIDIA NIXL through the `nixl-sys` bindings
//! (SGLang's `disaggregation/nixl/conn.py` drives NIXL the same way from Python).
//!
//! | [`TransferEngine`] | NIXL |
//! |---|---|
//! | the engine | one agent (`nixlAgent`, named by [`NixlConfig::agent_name`]) with one backend plugin (UCX by default) |
//! | [`register`](TransferEngine::register) | `registerMem` of DRAM descriptors, one per region, in the regions' order |
//! | [`segment`](TransferEngine::segment) | endpoint = the agent's name, `metadata` = `getLocalMD`, each region's address as [`RemoteRegion::base`] |
//! | [`open_segment`](TransferEngine::open_segment) | `loadRemoteMD` of the descriptor's metadata (its agent must be the endpoint) |
//! | [`close_segment`](TransferEngine::close_segment) | the segment's pending requests are released (NIXL aborts them), `invalidateRemoteMD` once no open segment names that agent |
//! | [`submit`](TransferEngine::submit) | `createXferReq(NIXL_WRITE, local descriptors, remote descriptors, agent)` with a notification (`kvserve batch N`), then `postXferReq` |
//! | [`poll`](TransferEngine::poll) / [`wait`](TransferEngine::wait) | `getXferStatus`; the request is released when the batch is reaped |
//!
//! ## Invariants
//! - Nothing calls into NIXL before [`available`] said a real NIXL library is loaded: built with
//!   `nixl-sys`'s stub API (as CI builds it), every NIXL call would abort the process, so
//!   [`NixlTransferEngine::new`] refuses first with a [`TransferError::Backend`] naming NIXL.
//! - Every batch and registration is validated whole in plain Rust (the `plan` module) before
//!   NIXL sees it; NIXL's own refusals come back as [`TransferError::Backend`] with NIXL's text.
//! - Host memory only (`DRAM` descriptors, device id 0): a device KV store would need its memory
//!   kind and device id in the segment descriptor.
//! - Notifications other agents send to this one (the `kvserve batch N` of their writes) are
//!   drained by a background thread into a bounded log ([`NixlTransferEngine::take_notifications`]),
//!   so an engine that only receives never accumulates them inside NIXL.
//! - All NIXL calls of one engine are serialized by its state lock (and the agent is created
//!   with NIXL's strict thread sync besides).

mod plan;

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use kv_pool::MemoryRegion;
use nixl_sys::{
    Agent, AgentConfig, MemType, NixlDescriptor, NixlError, NotificationMap, OptArgs,
    RegistrationHandle, ThreadSync, XferDescList, XferOp, XferRequest, XferStatus,
};

use crate::engine::{
    BackendKind, BatchId, BatchStatus, RegionId, RemoteRegion, SegmentDesc, SegmentId,
    TransferBlock, TransferEngine,
};
use crate::error::{Result, TransferError};
use plan::{Span, WriteDesc};

/// How many received notifications the log keeps (oldest dropped first).
const NOTIFICATION_LOG: usize = 1024;

/// Whether a real NIXL library is loaded in this process. `false` when `nixl-sys` was built with
/// its stub API and `libnixl_capi.so` is not on the library path: then no NIXL call may be made.
pub fn available() -> bool {
    !nixl_sys::is_stub()
}

/// How to build a [`NixlTransferEngine`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlConfig {
    /// The NIXL agent's name: unique among every engine that opens this one's segment (SGLang
    /// uses a UUID). It is the segment's endpoint.
    pub agent_name: String,
    /// The NIXL backend plugin (SGLang's default: `"UCX"`).
    pub plugin: String,
    /// How long [`wait`](TransferEngine::wait) waits for one batch before it fails with
    /// [`TransferError::Timeout`] (and the request is released).
    pub wait_timeout: Duration,
    /// How often the background thread drains received notifications.
    pub notification_interval: Duration,
}

impl NixlConfig {
    /// A configuration with an explicit agent name, the UCX plugin, a 60 s wait bound and a
    /// 50 ms notification drain.
    pub fn new(agent_name: impl Into<String>) -> Self {
        Self {
            agent_name: agent_name.into(),
            plugin: "UCX".to_string(),
            wait_timeout: Duration::from_secs(60),
            notification_interval: Duration::from_millis(50),
        }
    }

    /// A configuration whose agent name is unique to this host, process and call:
    /// `kvserve-<host>-<pid>-<n>` (what the `new_engine` factory uses, from `TransferConfig::host`).
    pub fn unique(host: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        Self::new(format!("kvserve-{host}-{}-{n}", std::process::id()))
    }
}

/// A notification another agent sent this one (NIXL's notification map entry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlNotification {
    /// The sending agent's name.
    pub from: String,
    /// The message (`kvserve batch N` for this backend's writes).
    pub message: String,
}

/// [`TransferEngine`] over one NIXL agent. See the [module docs](self).
pub struct NixlTransferEngine {
    inner: Arc<Inner>,
}

struct Inner {
    // Dropped first: pending requests and registrations release before the agent goes.
    state: Mutex<State>,
    notifications: Mutex<NotificationLog>,
    agent: Agent,
    cfg: NixlConfig,
}

struct State {
    batches: BTreeMap<BatchId, Batch>,
    registrations: Vec<RegistrationHandle>,
    /// Registered regions, by [`RegionId`].
    local: Vec<Span>,
    /// `getLocalMD` after the last registration.
    metadata: Vec<u8>,
    segments: BTreeMap<SegmentId, Peer>,
    next_segment: u64,
    next_batch: u64,
}

struct Peer {
    agent: String,
    regions: Vec<RemoteRegion>,
}

enum Batch {
    Posted {
        segment: SegmentId,
        req: XferRequest,
    },
    Finished(BatchStatus),
}

#[derive(Default)]
struct NotificationLog {
    recent: VecDeque<NixlNotification>,
    received: u64,
}

/// Host memory to register (one region).
#[derive(Debug)]
struct HostRegion(Span);

impl nixl_sys::MemoryRegion for HostRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0.addr as usize as *const u8
    }

    fn size(&self) -> usize {
        self.0.len as usize
    }
}

impl NixlDescriptor for HostRegion {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// Maps a NIXL error to [`TransferError::Backend`], keeping NIXL's text and what was being done.
fn nixl_error(what: &str) -> impl Fn(NixlError) -> TransferError + '_ {
    move |e| backend_error(what, e.to_string())
}

fn backend_error(what: &str, message: String) -> TransferError {
    TransferError::Backend {
        backend: BackendKind::Nixl,
        what: what.to_string(),
        message,
    }
}

impl NixlTransferEngine {
    /// Creates the agent and its backend plugin. Fails with [`TransferError::Backend`] naming
    /// NIXL when no NIXL library is loaded ([`available`]), when the agent cannot be created, or
    /// when the plugin is missing (the message lists the plugins NIXL found).
    pub fn new(cfg: NixlConfig) -> Result<Self> {
        if !available() {
            return Err(backend_error(
                "load libnixl_capi.so",
                "NIXL is not installed: this build links nixl-sys's stub API and no \
                 libnixl_capi.so was found at run time (install NIXL, e.g. the nixl-cu12 wheel, \
                 and put its library directory on LD_LIBRARY_PATH)"
                    .to_string(),
            ));
        }
        if cfg.agent_name.is_empty() {
            return Err(backend_error(
                "create agent",
                "empty agent name".to_string(),
            ));
        }
        let agent_cfg = AgentConfig {
            thread_sync: ThreadSync::Strict,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(&cfg.agent_name, &agent_cfg)
            .map_err(nixl_error("create agent"))?;
        let plugin_error = |what: &str, e: NixlError| {
            let found: Vec<String> = agent
                .get_available_plugins()
                .map(|l| {
                    l.iter()
                        .filter_map(|p| p.ok().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default();
            backend_error(
                what,
                format!(
                    "{e} (plugin {:?}; plugins found: {found:?}; NIXL_PLUGIN_DIR={:?})",
                    cfg.plugin,
                    std::env::var("NIXL_PLUGIN_DIR").unwrap_or_default()
                ),
            )
        };
        let (_mems, params) = agent
            .get_plugin_params(&cfg.plugin)
            .map_err(|e| plugin_error("get plugin parameters", e))?;
        agent
            .create_backend(&cfg.plugin, &params)
            .map_err(|e| plugin_error("create backend", e))?;
        let metadata = agent
            .get_local_md()
            .map_err(nixl_error("get local metadata"))?;
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                batches: BTreeMap::new(),
                registrations: Vec::new(),
                local: Vec::new(),
                metadata,
                segments: BTreeMap::new(),
                next_segment: 0,
                next_batch: 0,
            }),
            notifications: Mutex::new(NotificationLog::default()),
            agent,
            cfg,
        });
        spawn_notification_drain(Arc::downgrade(&inner))?;
        Ok(Self { inner })
    }

    /// The agent's name (the segment's endpoint).
    pub fn agent_name(&self) -> &str {
        &self.inner.cfg.agent_name
    }

    /// Takes the notifications received so far (the most recent 1024 of them),
    /// draining NIXL first.
    pub fn take_notifications(&self) -> Result<Vec<NixlNotification>> {
        self.inner.drain_notifications()?;
        Ok(lock(&self.inner.notifications).recent.drain(..).collect())
    }

    /// How many notifications this agent has received in all.
    pub fn notifications_received(&self) -> u64 {
        // Best effort: a drain failure shows up in `take_notifications`.
        let _ = self.inner.drain_notifications();
        lock(&self.inner.notifications).received
    }
}

/// Drains the agent's notifications every `notification_interval` until the engine is dropped.
fn spawn_notification_drain(inner: Weak<Inner>) -> Result<()> {
    let interval = match inner.upgrade() {
        Some(i) => i.cfg.notification_interval,
        None => return Ok(()),
    };
    std::thread::Builder::new()
        .name("nixl-notifications".to_string())
        .spawn(move || {
            while let Some(inner) = inner.upgrade() {
                // A failure here is seen again by the next `take_notifications`.
                let _ = inner.drain_notifications();
                drop(inner);
                std::thread::sleep(interval);
            }
        })
        .map_err(|e| TransferError::io("start the NIXL notification thread", &e))?;
    Ok(())
}

/// Locks a mutex; a panic while it was held cannot leave this module's state half-updated
/// (every update is a single insert or remove), so poisoning is ignored.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    fn drain_notifications(&self) -> Result<()> {
        let taken = {
            let _state = lock(&self.state);
            let mut map = NotificationMap::new().map_err(nixl_error("create notification map"))?;
            self.agent
                .get_notifications(&mut map, None)
                .map_err(nixl_error("get notifications"))?;
            map.take_notifs()
                .map_err(nixl_error("read notifications"))?
        };
        let mut log = lock(&self.notifications);
        for (from, messages) in taken {
            for message in messages {
                log.received += 1;
                if log.recent.len() == NOTIFICATION_LOG {
                    log.recent.pop_front();
                }
                log.recent.push_back(NixlNotification {
                    from: from.clone(),
                    message,
                });
            }
        }
        Ok(())
    }

    /// Creates and posts one write request; `None` when NIXL finished it within the post.
    fn post(&self, peer: &str, id: BatchId, writes: &[WriteDesc]) -> Result<Option<XferRequest>> {
        let mut local =
            XferDescList::new(MemType::Dram).map_err(nixl_error("create descriptors"))?;
        let mut remote =
            XferDescList::new(MemType::Dram).map_err(nixl_error("create descriptors"))?;
        for w in writes {
            local.add_desc(w.local as usize, w.len as usize, 0);
            remote.add_desc(w.remote as usize, w.len as usize, 0);
        }
        let mut args = OptArgs::new().map_err(nixl_error("create transfer arguments"))?;
        args.set_notification_message(format!("kvserve batch {}", id.0).as_bytes())
            .and_then(|()| args.set_has_notification(true))
            .map_err(nixl_error("set the transfer notification"))?;
        let req = self
            .agent
            .create_xfer_req(XferOp::Write, &local, &remote, peer, Some(&args))
            .map_err(nixl_error("create transfer request"))?;
        let in_progress = self
            .agent
            .post_xfer_req(&req, None)
            .map_err(nixl_error("post transfer request"))?;
        Ok(in_progress.then_some(req))
    }

    fn poll(&self, id: BatchId) -> Result<BatchStatus> {
        let mut st = lock(&self.state);
        let status = match st.batches.get(&id).ok_or(TransferError::UnknownBatch(id))? {
            Batch::Finished(status) => status.clone(),
            Batch::Posted { req, .. } => match self.agent.get_xfer_status(req) {
                Ok(XferStatus::InProgress) => BatchStatus::Pending,
                Ok(XferStatus::Success) => BatchStatus::Done,
                Err(e) => BatchStatus::Failed(nixl_error("transfer")(e)),
            },
        };
        if status != BatchStatus::Pending {
            // Reaped: dropping the request releases it in NIXL.
            st.batches.remove(&id);
        }
        Ok(status)
    }
}

#[async_trait]
impl TransferEngine for NixlTransferEngine {
    fn kind(&self) -> BackendKind {
        BackendKind::Nixl
    }

    unsafe fn register(&self, regions: &[MemoryRegion]) -> Result<Vec<RegionId>> {
        let inner = &*self.inner;
        let mut st = lock(&inner.state);
        let spans = plan::check_new_regions(&st.local, regions)?;
        let first = st.local.len();
        if first + spans.len() > RegionId::MAX as usize {
            return Err(TransferError::BadRegion(format!(
                "more than {} regions",
                RegionId::MAX
            )));
        }
        if spans.is_empty() {
            return Ok(Vec::new());
        }
        // On any failure the handles registered so far drop here, which deregisters them:
        // nothing stays registered.
        let mut handles = Vec::with_capacity(spans.len());
        for span in &spans {
            let handle = inner
                .agent
                .register_memory(&HostRegion(*span), None)
                .map_err(nixl_error("register memory"))?;
            handles.push(handle);
        }
        let metadata = inner
            .agent
            .get_local_md()
            .map_err(nixl_error("get local metadata"))?;
        st.local.extend(spans);
        st.registrations.extend(handles);
        st.metadata = metadata;
        Ok((first as RegionId..st.local.len() as RegionId).collect())
    }

    fn segment(&self) -> SegmentDesc {
        let st = lock(&self.inner.state);
        SegmentDesc {
            backend: BackendKind::Nixl,
            endpoint: self.inner.cfg.agent_name.clone(),
            regions: st
                .local
                .iter()
                .map(|s| RemoteRegion {
                    len: s.len,
                    base: s.addr,
                })
                .collect(),
            metadata: st.metadata.clone(),
        }
    }

    async fn open_segment(&self, desc: &SegmentDesc) -> Result<SegmentId> {
        if desc.backend != BackendKind::Nixl {
            return Err(TransferError::BadSegment(format!(
                "a {} segment descriptor cannot be opened by the nixl backend",
                desc.backend
            )));
        }
        if desc.metadata.is_empty() {
            return Err(TransferError::BadSegment(format!(
                "segment of agent {:?} carries no NIXL agent metadata",
                desc.endpoint
            )));
        }
        plan::check_remote_regions(&desc.regions)?;
        let inner = &*self.inner;
        let mut st = lock(&inner.state);
        let agent = inner
            .agent
            .load_remote_md(&desc.metadata)
            .map_err(nixl_error("load remote metadata"))?;
        if agent != desc.endpoint {
            return Err(TransferError::BadSegment(format!(
                "the metadata is agent {agent:?}'s but the endpoint names {:?}",
                desc.endpoint
            )));
        }
        let id = SegmentId(st.next_segment);
        st.next_segment += 1;
        st.segments.insert(
            id,
            Peer {
                agent,
                regions: desc.regions.clone(),
            },
        );
        Ok(id)
    }

    async fn close_segment(&self, segment: SegmentId) -> Result<()> {
        let inner = &*self.inner;
        let mut st = lock(&inner.state);
        let peer = st
            .segments
            .remove(&segment)
            .ok_or(TransferError::UnknownSegment(segment))?;
        for batch in st.batches.values_mut() {
            if matches!(batch, Batch::Posted { segment: s, .. } if *s == segment) {
                // Dropping the request releases it: NIXL aborts what has not moved yet.
                *batch =
                    Batch::Finished(BatchStatus::Failed(TransferError::UnknownSegment(segment)));
            }
        }
        if !st.segments.values().any(|p| p.agent == peer.agent) {
            // Forgetting the peer's metadata only frees memory; the segment is closed either way.
            let _ = inner.agent.invalidate_remote_md(&peer.agent);
        }
        Ok(())
    }

    async fn submit(&self, segment: SegmentId, blocks: Vec<TransferBlock>) -> Result<BatchId> {
        let inner = &*self.inner;
        let mut st = lock(&inner.state);
        let peer = st
            .segments
            .get(&segment)
            .ok_or(TransferError::UnknownSegment(segment))?;
        let writes = plan::plan_writes(&st.local, &peer.regions, &blocks)?;
        let id = BatchId(st.next_batch);
        let batch = if writes.is_empty() {
            Batch::Finished(BatchStatus::Done)
        } else {
            match inner.post(&peer.agent, id, &writes)? {
                Some(req) => Batch::Posted { segment, req },
                None => Batch::Finished(BatchStatus::Done),
            }
        };
        st.next_batch += 1;
        st.batches.insert(id, batch);
        Ok(id)
    }

    fn poll(&self, batch: BatchId) -> Result<BatchStatus> {
        self.inner.poll(batch)
    }

    async fn wait(&self, batch: BatchId) -> Result<()> {
        let deadline = Instant::now() + self.inner.cfg.wait_timeout;
        let mut pause = Duration::from_micros(20);
        loop {
            match self.inner.poll(batch)? {
                BatchStatus::Done => return Ok(()),
                BatchStatus::Failed(e) => return Err(e),
                BatchStatus::Pending => {}
            }
            if Instant::now() >= deadline {
                // Released (NIXL aborts it) and forgotten: the batch failed.
                lock(&self.inner.state).batches.remove(&batch);
                return Err(TransferError::Timeout {
                    what: format!("NIXL batch {}", batch.0),
                    seconds: self.inner.cfg.wait_timeout.as_secs(),
                });
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

impl fmt::Debug for NixlTransferEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = lock(&self.inner.state);
        f.debug_struct("NixlTransferEngine")
            .field("agent", &self.inner.cfg.agent_name)
            .field("plugin", &self.inner.cfg.plugin)
            .field("regions", &st.local.len())
            .field("segments", &st.segments.len())
            .field("batches", &st.batches.len())
            .finish()
    }
}
