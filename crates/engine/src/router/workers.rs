//! The regular router's workers ([`WorkerRegistry`]): their URLs, ids, health and loads, as
//! sgl-router's worker registry keeps them. Workers come from `--worker-urls` and
//! `/add_worker`, leave by `/remove_worker`.
//!
//! Health: a worker starts healthy (`--worker-urls`) or as its first probe found it
//! (`/add_worker`); `--health-failure-threshold` failed checks in a row make it unhealthy,
//! `--health-success-threshold` passed ones healthy again. A request that cannot reach a
//! worker marks it unhealthy at once (no need to wait for the next check to stop sending
//! there). Load is the requests the router has in flight on the worker, counted by
//! [`InFlight`] guards.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, RwLock};

use super::config::{HealthConfig, WorkerUrl};
use super::policies::{Candidate, WorkerId};

/// One regular worker.
#[derive(Debug)]
pub struct Worker {
    /// The policies' name for it.
    pub id: WorkerId,
    /// Where it listens.
    pub url: WorkerUrl,
    healthy: AtomicBool,
    load: AtomicUsize,
    /// Checks in a row that went the other way than `healthy` says.
    streak: AtomicU32,
}

impl Worker {
    /// Whether requests may go to it.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Relaxed)
    }

    /// Requests in flight on it.
    pub fn load(&self) -> usize {
        self.load.load(Relaxed)
    }

    /// Takes it out of rotation at once (a request could not reach it).
    pub fn mark_unhealthy(&self) {
        self.healthy.store(false, Relaxed);
        self.streak.store(0, Relaxed);
    }

    /// Counts one health check's outcome; returns whether its health changed.
    pub fn record_check(&self, ok: bool, cfg: &HealthConfig) -> bool {
        if ok == self.is_healthy() {
            self.streak.store(0, Relaxed);
            return false;
        }
        let streak = self.streak.fetch_add(1, Relaxed) + 1;
        let needed = if ok {
            cfg.success_threshold
        } else {
            cfg.failure_threshold
        };
        if streak < needed {
            return false;
        }
        self.healthy.store(ok, Relaxed);
        self.streak.store(0, Relaxed);
        true
    }
}

/// A request in flight on a worker: counted in its load until dropped.
#[derive(Debug)]
pub struct InFlight(Arc<Worker>);

impl InFlight {
    /// Counts a request on `worker`.
    pub fn new(worker: Arc<Worker>) -> Self {
        worker.load.fetch_add(1, Relaxed);
        InFlight(worker)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.load.fetch_sub(1, Relaxed);
    }
}

/// Every regular worker, in the order added.
#[derive(Debug, Default)]
pub struct WorkerRegistry {
    workers: RwLock<Vec<Arc<Worker>>>,
    next_id: AtomicU32,
}

impl WorkerRegistry {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Worker>>> {
        self.workers.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Vec<Arc<Worker>>> {
        self.workers.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `url` (healthy or not); an error if it is there already.
    pub fn add(&self, url: WorkerUrl, healthy: bool) -> Result<Arc<Worker>, String> {
        let mut w = self.write();
        if w.iter().any(|x| x.url == url) {
            return Err(format!("worker {url} is already registered"));
        }
        let worker = Arc::new(Worker {
            id: WorkerId(self.next_id.fetch_add(1, Relaxed)),
            url,
            healthy: AtomicBool::new(healthy),
            load: AtomicUsize::new(0),
            streak: AtomicU32::new(0),
        });
        w.push(worker.clone());
        Ok(worker)
    }

    /// Removes `url`; the worker, or `None` if it was not there.
    pub fn remove(&self, url: &WorkerUrl) -> Option<Arc<Worker>> {
        let mut w = self.write();
        let i = w.iter().position(|x| &x.url == url)?;
        Some(w.remove(i))
    }

    /// Every worker now.
    pub fn all(&self) -> Vec<Arc<Worker>> {
        self.read().clone()
    }

    /// The healthy workers not in `exclude`, for a policy: the workers and their candidates.
    pub fn candidates(&self, exclude: &[WorkerId]) -> (Vec<Arc<Worker>>, Vec<Candidate>) {
        let workers: Vec<Arc<Worker>> = self
            .read()
            .iter()
            .filter(|w| w.is_healthy() && !exclude.contains(&w.id))
            .cloned()
            .collect();
        let candidates = workers
            .iter()
            .map(|w| Candidate {
                id: w.id,
                load: w.load(),
            })
            .collect();
        (workers, candidates)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn health_flips_after_its_thresholds_and_loads_follow_guards() {
        let reg = WorkerRegistry::default();
        let a = reg
            .add(WorkerUrl::parse("http://a:1").unwrap(), true)
            .unwrap();
        let b = reg
            .add(WorkerUrl::parse("http://b:1").unwrap(), true)
            .unwrap();
        assert!(reg
            .add(WorkerUrl::parse("http://a:1/").unwrap(), true)
            .is_err());
        assert_ne!(a.id, b.id);
        let cfg = HealthConfig {
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            failure_threshold: 2,
            success_threshold: 3,
        };
        assert!(!a.record_check(false, &cfg));
        assert!(!a.record_check(true, &cfg), "a pass resets the streak");
        assert!(!a.record_check(false, &cfg));
        assert!(a.record_check(false, &cfg));
        assert!(!a.is_healthy());
        let (_, c) = reg.candidates(&[]);
        assert_eq!(c.iter().map(|c| c.id).collect::<Vec<_>>(), [b.id]);
        for _ in 0..2 {
            assert!(!a.record_check(true, &cfg));
        }
        assert!(a.record_check(true, &cfg));
        let g1 = InFlight::new(b.clone());
        let g2 = InFlight::new(b.clone());
        assert_eq!(b.load(), 2);
        drop((g1, g2));
        assert_eq!(b.load(), 0);
        let (_, c) = reg.candidates(&[a.id]);
        assert_eq!(c.len(), 1);
        b.mark_unhealthy();
        assert!(reg.candidates(&[a.id]).1.is_empty());
        assert!(reg.remove(&a.url).is_some());
        assert!(reg.remove(&a.url).is_none());
        assert_eq!(reg.all().len(), 1);
    }
}
