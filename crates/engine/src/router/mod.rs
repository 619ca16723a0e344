//! `kvserve router`: sgl-router (`sglang_router.launch_router`) in front of kvserve (or
//! SGLang) servers, in one of two modes.
//!
//! Regular mode (`--worker-urls URL…`, sgl-router's `router.rs`): each generation request
//! goes to one worker, chosen among the healthy ones by a [`policies::LoadBalancingPolicy`]
//! (`random`, `round_robin`, `power_of_two`, `cache_aware`, `kv_events`) from the request's prompt and the
//! router's in-flight counts; see [`regular`] for retries. Workers are health-checked, and
//! added and removed at run time (`/add_worker`, `/remove_worker`, `/list_workers`).
//!
//! PD mode (`--pd-disaggregation`, sgl-router's `pd_router.rs`): each generation request (`/generate`, `/v1/completions`, `/v1/chat/completions`) gets a
//! prefill worker from the prefill policy and a decode worker from the decode policy (any of
//! the regular mode's but `kv_events`, on the router's in-flight counts), a random `bootstrap_room`,
//! and the prefill's `bootstrap_host` / `bootstrap_port`; it is sent to both at once and
//! answered from decode (its stream relayed as it arrives), with the prefill's cached-token
//! count merged in. A worker that fails ends the request with a 502 naming it (or, once a
//! stream has started, with an error event naming it), and the other request is dropped so
//! its server frees what it holds. Where SGLang's router differs: it does not wait for the
//! prefill's answer (we do, for its cached-token count and its failures), and a `--prefill`
//! without a port injects SGLang's default 8998 rather than `null`.
//!
//! One job per module, in the direction calls go (no module imports one that imports it):
//! - [`config`]: the flags ([`RouterArgs`]) and the validated [`RouterConfig`];
//! - [`policy`]: the selector behind `random` / `round_robin` (and the policies' random
//!   draws) and bootstrap rooms;
//! - [`policies`]: the regular mode's policies behind one trait (a simulator can run them);
//! - [`workers`]: the regular workers, their health and loads; [`health`]: their checks and
//!   the policy's periodic trim; [`admin`]: `/add_worker`, `/remove_worker`, `/list_workers`;
//! - [`kv_subscriber`]: the `kv_events` policy's ZMQ subscribers, feeding its index;
//! - [`prompt`]: what a body routes on; [`regular`]: the regular mode's dispatch and retry;
//! - [`answer`]: the request timer and error answers both modes share;
//! - [`inject`]: the bootstrap fields in the request body, the prefill's copy;
//! - [`merge`]: cached-token merging, server-sent-event parsing;
//! - [`upstream`]: one call to a worker and its failures ([`upstream::UpstreamError`]);
//! - [`proxy`] (the dual dispatch) and [`relay`] (the streamed answer);
//! - [`info`]: `/health`, `/metrics`, `/get_server_info`, `/v1/models`, `/flush_cache`;
//! - [`metrics`]: the router's Prometheus counters and latency histogram.
//!
//! The command (`src/commands/router.rs`) runs [`serve`] until Ctrl-C; tests and programs
//! embed a router with [`spawn`].

pub mod admin;
pub mod answer;
pub mod config;
pub mod health;
pub mod info;
pub mod inject;
pub mod kv_subscriber;
pub mod merge;
pub mod metrics;
pub mod policies;
pub mod policy;
pub mod prompt;
pub mod proxy;
pub mod regular;
pub mod relay;
pub mod upstream;
pub mod workers;

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::{get, post};

pub use config::{
    CacheAwareConfig, EventSource, HealthConfig, PolicyKind, PrefillWorker, RouterArgs,
    RouterConfig, WorkerUrl,
};
pub use metrics::RouterMetrics;

use crate::error::{EngineError, Result};
use metrics::Role;
use policies::Prompt;
use policies::{KvIndex, LoadBalancingPolicy};
use policy::RoomGenerator;
use workers::{InFlight, WorkerRegistry};

/// What every request of one router shares.
#[derive(Debug)]
pub struct RouterState {
    /// The workers and settings.
    pub config: RouterConfig,
    /// The HTTP client to the workers (connect and read timeouts from `config`).
    client: reqwest::Client,
    /// PD mode: the prefill servers as the policies see them (ids and in-flight loads, in the
    /// order of `config.prefill`), and the policy that picks one.
    prefill_workers: WorkerRegistry,
    prefill_policy: Box<dyn LoadBalancingPolicy>,
    /// PD mode: the decode servers likewise (in the order of `config.decode`) and theirs.
    decode_workers: WorkerRegistry,
    decode_policy: Box<dyn LoadBalancingPolicy>,
    rooms: RoomGenerator,
    /// Regular mode: the workers.
    pub workers: WorkerRegistry,
    /// Regular mode: how a worker is picked.
    pub policy: Box<dyn LoadBalancingPolicy>,
    /// `kv_events`: which worker holds which pages (its subscribers write it).
    pub kv_index: Arc<Mutex<KvIndex>>,
    /// `kv_events`: each worker's event subscriber.
    pub subscribers: kv_subscriber::Subscribers,
    /// The router's counters.
    pub metrics: RouterMetrics,
    /// `--tokenizer-path`: the workers' tokenizer, so text prompts route on token ids.
    pub prompt_encoder: Option<prompt::PromptEncoder>,
}

impl RouterState {
    /// The state for `config` (fails only if the HTTP client cannot be built).
    pub fn new(config: RouterConfig) -> Result<Self> {
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .read_timeout(config.request_timeout)
            .build()
            .map_err(|e| EngineError::Io {
                path: "the router's HTTP client".into(),
                source: std::io::Error::other(e),
            })?;
        let workers = WorkerRegistry::default();
        for url in &config.workers {
            // Distinct by construction (`RouterArgs::config` refuses duplicates).
            let _ = workers.add(url.clone(), true);
        }
        let kv_index = Arc::new(Mutex::new(KvIndex::default()));
        let prompt_encoder = config
            .tokenizer
            .as_ref()
            .map(prompt::PromptEncoder::load)
            .transpose()?;
        let prefill_workers = WorkerRegistry::default();
        for p in &config.prefill {
            let _ = prefill_workers.add(p.url.clone(), true);
        }
        let decode_workers = WorkerRegistry::default();
        for d in &config.decode {
            let _ = decode_workers.add(d.clone(), true);
        }
        Ok(RouterState {
            prefill_workers,
            prefill_policy: policies::build(
                config.prefill_policy,
                config.cache_aware,
                None,
                Arc::default(),
            ),
            decode_workers,
            decode_policy: policies::build(
                config.decode_policy,
                config.cache_aware,
                None,
                Arc::default(),
            ),
            rooms: RoomGenerator::default(),
            workers,
            policy: policies::build(config.policy, config.cache_aware, None, kv_index.clone()),
            kv_index,
            subscribers: kv_subscriber::Subscribers::default(),
            prompt_encoder,
            metrics: RouterMetrics::with_workers(
                (config
                    .prefill
                    .iter()
                    .map(|p| (Role::Prefill, p.url.base().to_string())))
                .chain(
                    config
                        .decode
                        .iter()
                        .map(|d| (Role::Decode, d.base().to_string())),
                )
                .chain(
                    config
                        .workers
                        .iter()
                        .map(|w| (Role::Worker, w.base().to_string())),
                ),
            ),
            client,
            config,
        })
    }

    /// The prefill and decode workers of the next request, each chosen by its role's policy
    /// from `prompt` and the router's in-flight counts, and counted in flight until its guard
    /// drops (sgl-router's PD router: `select_pd_pair`).
    pub fn pick(&self, prompt: &Prompt) -> PdPick<'_> {
        // Every server is a candidate (PD mode does not health-check them), in order.
        let choose = |registry: &WorkerRegistry, policy: &dyn LoadBalancingPolicy, n: usize| {
            let (workers, candidates) = registry.candidates(&[]);
            let i = policy.select(&candidates, prompt).unwrap_or(0).min(n - 1);
            (i, InFlight::new(workers[i].clone()))
        };
        let (p, prefill_in_flight) = choose(
            &self.prefill_workers,
            self.prefill_policy.as_ref(),
            self.config.prefill.len(),
        );
        let (d, decode_in_flight) = choose(
            &self.decode_workers,
            self.decode_policy.as_ref(),
            self.config.decode.len(),
        );
        PdPick {
            prefill: &self.config.prefill[p],
            decode: &self.config.decode[d],
            in_flight: [prefill_in_flight, decode_in_flight],
        }
    }
}

/// A PD request's workers ([`RouterState::pick`]); both count it in flight while this lives.
#[derive(Debug)]
pub struct PdPick<'a> {
    /// The prefill server.
    pub prefill: &'a PrefillWorker,
    /// The decode server.
    pub decode: &'a WorkerUrl,
    /// The in-flight guards of the prefill and the decode server.
    pub in_flight: [InFlight; 2],
}

/// The router's routes.
pub fn app(state: Arc<RouterState>) -> axum::Router {
    let mut r = axum::Router::new();
    for route in ["/generate", "/v1/completions", "/v1/chat/completions"] {
        r = if state.config.is_pd() {
            r.route(
                route,
                post(move |s: State<Arc<RouterState>>, h: HeaderMap, b: Bytes| {
                    proxy::dual_dispatch(s.0, route, h, b)
                }),
            )
        } else {
            r.route(
                route,
                post(move |s: State<Arc<RouterState>>, h: HeaderMap, b: Bytes| {
                    regular::route(s.0, route, h, b)
                }),
            )
        };
    }
    r.route("/add_worker", post(admin::add_worker))
        .route("/remove_worker", post(admin::remove_worker))
        .route("/list_workers", get(admin::list_workers))
        .route("/v1/models", get(info::models))
        .route("/health", get(info::health))
        .route("/metrics", get(info::metrics))
        .route("/get_server_info", get(info::server_info))
        .route("/flush_cache", post(info::flush_cache))
        .with_state(state)
}

/// Serves a router for `config` on `listener` until `shutdown` resolves. Requests still in
/// flight then are not waited for: they end when the runtime does.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: RouterConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let local = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let state = Arc::new(RouterState::new(config)?);
    let upkeep = {
        let state = state.clone();
        async move {
            if state.config.is_pd() {
                std::future::pending::<()>().await;
            }
            let workers = state.workers.all();
            for (w, source) in workers.iter().zip(&state.config.kv_events) {
                state.subscribers.start(
                    source.clone(),
                    state.config.kv_events_topic.clone(),
                    w.id,
                    state.kv_index.clone(),
                );
            }
            tokio::join!(
                health::health_loop(state.clone()),
                health::maintenance_loop(state)
            );
        }
    };
    let server = std::future::IntoFuture::into_future(axum::serve(listener, app(state.clone())));
    let r = tokio::select! {
        r = server => r.map_err(|source| EngineError::Io { path: local, source }),
        () = shutdown => Ok(()),
        () = upkeep => Ok(()),
    };
    state.subscribers.stop_all();
    r
}

/// A router on its own thread and tokio runtime, stopped on drop: for tests and programs that
/// embed one.
#[derive(Debug)]
pub struct BackgroundRouter {
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Drop for BackgroundRouter {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Binds `addr` (port 0: any free port) and serves a router for `config` on a new thread
/// with a runtime of `worker_threads` threads. Dropping the result stops it; streams still
/// open are cut.
pub fn spawn(config: RouterConfig, addr: &str, worker_threads: usize) -> Result<BackgroundRouter> {
    let io = |source| EngineError::Io {
        path: addr.to_string(),
        source,
    };
    // Bound here with std (no runtime needed, so callers may be inside one), served there.
    let listener = std::net::TcpListener::bind(addr).map_err(io)?;
    listener.set_nonblocking(true).map_err(io)?;
    let local = listener.local_addr().map_err(io)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads.max(1))
        .enable_all()
        .build()
        .map_err(io)?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let path = addr.to_string();
    let thread = std::thread::Builder::new()
        .name("kvserve-router".into())
        .spawn(move || {
            let r = rt.block_on(async {
                let listener = tokio::net::TcpListener::from_std(listener)
                    .map_err(|source| EngineError::Io { path, source })?;
                serve(listener, config, async {
                    let _ = stopped.await;
                })
                .await
            });
            // Cut streams still open rather than wait for them.
            rt.shutdown_background();
            r
        })
        .map_err(io)?;
    Ok(BackgroundRouter {
        addr: local,
        stop: Some(stop),
        thread: Some(thread),
    })
}
