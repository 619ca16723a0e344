//! The bootstrap server on the prefill side and its client on the decode side (SGLang's
//! `CommonKVBootstrapServer` and the decode's `_get_prefill_parallel_info_from_server` /
//! `_get_bootstrap_info_from_server`, `disaggregation/common/conn.py`).
//!
//! Routes: `PUT /route` registers a prefill rank (its control address and [`ServerCompat`]);
//! `GET /route` without `engine_rank` (or with `-1`) answers the [`ServerInfo`], `503` until a
//! rank registered; `GET /route?engine_rank=N` answers `{rank_ip, rank_port}` (`404` for a rank
//! never registered); `GET /health` answers `200 OK`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::pd::config::ServerCompat;
use crate::pd::error::PdError;
use crate::pd::log;

/// A prefill rank's registration (`PUT /route` body).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankRegistration {
    /// Always `"Prefill"` (SGLang's field).
    pub role: String,
    /// The rank's control-channel host.
    pub rank_ip: String,
    /// The rank's control-channel port.
    pub rank_port: u16,
    /// The rank (0 without tensor parallelism).
    pub engine_rank: i64,
    /// What a decode server must match.
    pub compat: ServerCompat,
}

/// `GET /route` without a rank: the prefill server's parallel info and compatibility record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// Registered ranks.
    pub ranks: usize,
    /// The compatibility record of rank 0.
    pub compat: ServerCompat,
}

/// `GET /route?engine_rank=N`: where rank `N`'s control channel listens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankAddr {
    /// Host.
    pub rank_ip: String,
    /// Port.
    pub rank_port: u16,
}

#[derive(Deserialize)]
struct RouteQuery {
    engine_rank: Option<i64>,
}

type Ranks = Arc<Mutex<BTreeMap<i64, RankRegistration>>>;

/// A running bootstrap server; [`BootstrapServer::stop`] (or dropping it) stops it.
#[derive(Debug)]
pub(crate) struct BootstrapServer {
    addr: SocketAddr,
    stop: Mutex<Option<oneshot::Sender<()>>>,
}

impl BootstrapServer {
    /// Binds `host:port` (0 = any free port) and serves on `rt`.
    pub(crate) fn start(
        host: &str,
        port: u16,
        rt: &tokio::runtime::Handle,
    ) -> Result<Self, PdError> {
        let std_listener = std::net::TcpListener::bind((host, port)).map_err(|e| {
            PdError::Invalid(format!("bootstrap server: cannot bind {host}:{port}: {e}"))
        })?;
        std_listener
            .set_nonblocking(true)
            .map_err(|e| PdError::Invalid(format!("bootstrap server: {e}")))?;
        let addr = std_listener
            .local_addr()
            .map_err(|e| PdError::Invalid(format!("bootstrap server: {e}")))?;
        let listener = {
            let _guard = rt.enter();
            tokio::net::TcpListener::from_std(std_listener)
                .map_err(|e| PdError::Invalid(format!("bootstrap server: {e}")))?
        };
        let ranks: Ranks = Arc::default();
        let app = Router::new()
            .route("/route", get(get_route).put(put_route))
            .route("/health", get(|| async { "OK" }))
            .with_state(ranks);
        let (tx, rx) = oneshot::channel::<()>();
        rt.spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.await;
                })
                .await;
            if let Err(e) = served {
                log(format_args!("bootstrap server on {addr} stopped: {e}"));
            }
        });
        Ok(BootstrapServer {
            addr,
            stop: Mutex::new(Some(tx)),
        })
    }

    /// Where it listens.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and answering; idempotent.
    pub(crate) fn stop(&self) {
        if let Some(tx) = self.stop.lock().expect("poisoned").take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn put_route(State(ranks): State<Ranks>, Json(reg): Json<RankRegistration>) -> StatusCode {
    ranks.lock().expect("poisoned").insert(reg.engine_rank, reg);
    StatusCode::OK
}

async fn get_route(State(ranks): State<Ranks>, Query(q): Query<RouteQuery>) -> Response {
    let ranks = ranks.lock().expect("poisoned");
    match q.engine_rank {
        None | Some(-1) => match ranks.get(&0) {
            Some(r0) => Json(ServerInfo {
                ranks: ranks.len(),
                compat: r0.compat.clone(),
            })
            .into_response(),
            None => (
                StatusCode::SERVICE_UNAVAILABLE,
                "prefill ranks have not registered yet",
            )
                .into_response(),
        },
        Some(rank) => match ranks.get(&rank) {
            Some(r) => Json(RankAddr {
                rank_ip: r.rank_ip.clone(),
                rank_port: r.rank_port,
            })
            .into_response(),
            None => (
                StatusCode::NOT_FOUND,
                format!("rank {rank} is not registered"),
            )
                .into_response(),
        },
    }
}

/// `host` as peers should dial it: wildcards become loopback (SGLang does the same).
pub(crate) fn advertised(host: &str) -> String {
    match host {
        "0.0.0.0" | "::" | "[::]" | "" => "127.0.0.1".into(),
        h => h.into(),
    }
}

/// A plain-HTTP client with `timeout` per request and no connection reuse (a heartbeat must
/// open a fresh connection, or a dead server's kept-alive socket could still answer).
pub(crate) fn http_client(timeout: Duration) -> Result<reqwest::Client, PdError> {
    reqwest::Client::builder()
        .timeout(timeout)
        .pool_max_idle_per_host(0)
        .build()
        .map_err(|e| PdError::Invalid(format!("http client: {e}")))
}

fn bootstrap_err(addr: &str, reason: impl ToString) -> PdError {
    PdError::Bootstrap {
        addr: addr.into(),
        reason: reason.to_string(),
    }
}

async fn get_json<T: for<'de> Deserialize<'de>>(
    client: &reqwest::Client,
    addr: &str,
    path: &str,
) -> Result<T, PdError> {
    let resp = client
        .get(format!("http://{addr}{path}"))
        .send()
        .await
        .map_err(|e| bootstrap_err(addr, format!("GET {path}: {e}")))?;
    let status = resp.status();
    let body = resp
        .bytes()
        .await
        .map_err(|e| bootstrap_err(addr, format!("GET {path}: {e}")))?;
    if !status.is_success() {
        let text = String::from_utf8_lossy(&body);
        return Err(bootstrap_err(addr, format!("GET {path}: {status}: {text}")));
    }
    serde_json::from_slice(&body).map_err(|e| bootstrap_err(addr, format!("GET {path}: {e}")))
}

/// Decode side: the prefill's [`ServerInfo`].
pub(crate) async fn fetch_server_info(
    client: &reqwest::Client,
    addr: &str,
) -> Result<ServerInfo, PdError> {
    get_json(client, addr, "/route").await
}

/// Decode side: rank `rank`'s control address as `ip:port`.
pub(crate) async fn fetch_rank(
    client: &reqwest::Client,
    addr: &str,
    rank: i64,
) -> Result<String, PdError> {
    let r: RankAddr = get_json(client, addr, &format!("/route?engine_rank={rank}")).await?;
    Ok(format!("{}:{}", r.rank_ip, r.rank_port))
}

/// Decode side: whether `/health` answers 200.
pub(crate) async fn health(client: &reqwest::Client, addr: &str) -> bool {
    match client.get(format!("http://{addr}/health")).send().await {
        Ok(r) => r.status().is_success(),
        Err(_) => false,
    }
}

/// Prefill side: `PUT /route` with `attempts` tries, backoff doubling from `first` up to 30 s
/// (SGLang: 5 attempts, 1 s → 30 s).
pub(crate) async fn register_rank(
    addr: SocketAddr,
    reg: &RankRegistration,
    attempts: u32,
    first: Duration,
) -> Result<(), PdError> {
    let client = http_client(Duration::from_secs(10))?;
    let mut delay = first;
    let mut last = String::new();
    for attempt in 1..=attempts {
        match client
            .put(format!("http://{addr}/route"))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(reg).map_err(|e| PdError::Invalid(e.to_string()))?)
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => last = format!("PUT /route: {}", r.status()),
            Err(e) => last = format!("PUT /route: {e}"),
        }
        if attempt < attempts {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(30));
        }
    }
    Err(bootstrap_err(
        &addr.to_string(),
        format!("registration failed after {attempts} attempts: {last}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::BackendKind;

    fn reg() -> RankRegistration {
        RankRegistration {
            role: "Prefill".into(),
            rank_ip: "127.0.0.1".into(),
            rank_port: 1,
            engine_rank: 0,
            compat: ServerCompat {
                model: "m".into(),
                page_size: 1,
                kv_dtype: "float16".into(),
                page_bytes: 8,
                regions: 2,
                transfer_backend: BackendKind::Tcp,
            },
        }
    }

    #[tokio::test]
    async fn registration_retries_then_names_the_last_error() {
        // A port nobody listens on: bind, read the port, close.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let t = std::time::Instant::now();
        let err = register_rank(port, &reg(), 3, Duration::from_millis(5))
            .await
            .unwrap_err();
        assert!(
            t.elapsed() >= Duration::from_millis(15),
            "5 + 10 ms of backoff"
        );
        let text = err.to_string();
        assert!(
            text.contains("registration failed after 3 attempts"),
            "{text}"
        );
    }

    #[test]
    fn wildcards_are_advertised_as_loopback() {
        assert_eq!(advertised("0.0.0.0"), "127.0.0.1");
        assert_eq!(advertised("10.0.0.2"), "10.0.0.2");
    }
}
