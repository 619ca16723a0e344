//! The CPU backend's one pool of worker threads, made with the backend and kept for its
//! lifetime (no thread is spawned per op). Every parallel op hands it a fixed list of jobs
//! whose results do not depend on which thread runs which job or in what order, so the pool's
//! scheduling never changes a result.

use std::fmt;
use std::sync::Arc;

use rayon::prelude::*;

use crate::error::{AttentionError, Result};

/// `threads` workers (none of its own for one thread: the caller runs the jobs).
#[derive(Clone)]
pub(crate) struct Pool {
    threads: usize,
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl Default for Pool {
    fn default() -> Self {
        Pool {
            threads: 1,
            pool: None,
        }
    }
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads)
            .finish()
    }
}

impl Pool {
    /// A pool of `threads` workers (`≥ 1`; one runs everything on the caller).
    pub(crate) fn new(threads: usize) -> Result<Self> {
        if threads == 0 {
            return Err(AttentionError::InvalidConfig {
                field: "threads",
                reason: "must be at least 1".into(),
            });
        }
        if threads == 1 {
            return Ok(Pool::default());
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kvserve-cpu-{i}"))
            .build()
            .map_err(|e| AttentionError::InvalidConfig {
                field: "threads",
                reason: format!("cannot start {threads} worker threads: {e}"),
            })?;
        Ok(Pool {
            threads,
            pool: Some(Arc::new(pool)),
        })
    }

    /// The number of workers.
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `job` on every item and returns when all have run: spread over the workers when
    /// there are several items and several workers, else in order on the calling thread.
    pub(crate) fn for_each<T: Send>(&self, items: Vec<T>, job: impl Fn(T) + Sync + Send) {
        match &self.pool {
            Some(pool) if items.len() > 1 => {
                pool.install(|| items.into_par_iter().with_max_len(1).for_each(job))
            }
            _ => items.into_iter().for_each(job),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    #[test]
    fn zero_threads_is_a_typed_error() {
        assert!(matches!(
            Pool::new(0),
            Err(AttentionError::InvalidConfig {
                field: "threads",
                ..
            })
        ));
    }

    /// Every item runs exactly once, on up to `threads` distinct threads, for any count.
    #[test]
    fn every_item_runs_once() {
        for threads in 1..=3 {
            let pool = Pool::new(threads).unwrap();
            assert_eq!(pool.threads(), threads);
            for items in [0usize, 1, 2, 7] {
                let hits: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
                let names = Mutex::new(std::collections::HashSet::new());
                pool.for_each((0..items).collect(), |i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                    names.lock().unwrap().insert(std::thread::current().id());
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                assert!(names.lock().unwrap().len() <= threads.max(1));
            }
        }
    }
}
