//! `kvserve router --pd-disaggregation`: SGLang's PD router (`sglang_router.launch_router`,
//! sgl-router's `pd_router.rs`) in front of kvserve (or SGLang) prefill and decode servers.
//!
//! Each generation request (`/generate`, `/v1/completions`, `/v1/chat/completions`) gets a
//! prefill and a decode worker from the role's selection policy, a random `bootstrap_room`,
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
//! - [`policy`]: worker selection (`random`, `round_robin`) and bootstrap rooms;
//! - [`inject`]: the bootstrap fields in the request body, the prefill's copy;
//! - [`merge`]: cached-token merging, server-sent-event parsing;
//! - [`upstream`]: one call to a worker and its failures ([`upstream::UpstreamError`]);
//! - [`proxy`] (the dual dispatch) and [`relay`] (the streamed answer);
//! - [`info`]: `/health`, `/metrics`, `/get_server_info`, `/v1/models`, `/flush_cache`;
//! - [`metrics`]: the router's Prometheus counters and latency histogram.
//!
//! The command (`src/commands/router.rs`) runs [`serve`] until Ctrl-C; tests and programs
//! embed a router with [`spawn`].

pub mod config;
pub mod info;
pub mod inject;
pub mod merge;
pub mod metrics;
pub mod policy;
pub mod proxy;
pub mod relay;
pub mod upstream;

use std::sync::Arc;

use axum::routing::{get, post};

pub use config::{PolicyKind, PrefillWorker, RouterArgs, RouterConfig, WorkerUrl};
pub use metrics::RouterMetrics;

use crate::error::{EngineError, Result};
use metrics::Role;
use policy::{RoomGenerator, Selector};

/// What every request of one router shares.
#[derive(Debug)]
pub struct RouterState {
    /// The workers and settings.
    pub config: RouterConfig,
    /// The HTTP client to the workers (connect and read timeouts from `config`).
    client: reqwest::Client,
    prefill_selector: Selector,
    decode_selector: Selector,
    rooms: RoomGenerator,
    /// The router's counters.
    pub metrics: RouterMetrics,
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
        Ok(RouterState {
            prefill_selector: Selector::new(config.prefill_policy),
            decode_selector: Selector::new(config.decode_policy),
            rooms: RoomGenerator::default(),
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
                ),
            ),
            client,
            config,
        })
    }

    /// The prefill and decode workers of the next request.
    pub fn pick(&self) -> (&PrefillWorker, &WorkerUrl) {
        let p = self.prefill_selector.pick(self.config.prefill.len());
        let d = self.decode_selector.pick(self.config.decode.len());
        (&self.config.prefill[p], &self.config.decode[d])
    }
}

/// The router's routes.
pub fn app(state: Arc<RouterState>) -> axum::Router {
    axum::Router::new()
        .route("/generate", post(proxy::generate))
        .route("/v1/completions", post(proxy::completions))
        .route("/v1/chat/completions", post(proxy::chat_completions))
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
    let server = std::future::IntoFuture::into_future(axum::serve(listener, app(state)));
    tokio::select! {
        r = server => r.map_err(|source| EngineError::Io { path: local, source }),
        () = shutdown => Ok(()),
    }
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
