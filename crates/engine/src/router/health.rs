//! The regular router's background upkeep: health checks of every worker (`GET /health` each
//! `--health-check-interval-secs`, answered 2xx within `--health-check-timeout-secs` or
//! failed) and the policy's periodic trim (`--eviction-interval`). Both run until the router
//! stops.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;

use super::config::WorkerUrl;
use super::RouterState;

/// Whether `url` answers `GET /health` with a 2xx within `timeout`.
pub async fn probe(client: &reqwest::Client, url: &WorkerUrl, timeout: Duration) -> bool {
    let req = client.get(url.join("/health")).timeout(timeout).send();
    matches!(req.await, Ok(r) if r.status().is_success())
}

/// Checks every worker once, all at once; records each outcome.
pub async fn check_all(state: &Arc<RouterState>) {
    let cfg = state.config.health;
    let mut tasks = JoinSet::new();
    for w in state.workers.all() {
        let client = state.client.clone();
        tasks.spawn(async move {
            let ok = probe(&client, &w.url, cfg.timeout).await;
            if w.record_check(ok, &cfg) {
                let now = if ok { "healthy" } else { "unhealthy" };
                eprintln!("kvserve: router: worker {} is {now}", w.url);
            }
        });
    }
    tasks.join_all().await;
}

/// Health checks every interval, forever.
pub async fn health_loop(state: Arc<RouterState>) {
    let mut tick = tokio::time::interval(state.config.health.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // the first tick is immediate: workers start as given
    loop {
        tick.tick().await;
        check_all(&state).await;
    }
}

/// The policy's trim every `--eviction-interval` seconds, forever.
pub async fn maintenance_loop(state: Arc<RouterState>) {
    let every = Duration::from_secs(state.config.cache_aware.eviction_interval_secs.max(1));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        state.policy.maintain();
    }
}
