//! The CPU backend's one pool of worker threads, made with the backend and kept for its
//! lifetime (no thread is spawned per op). Every parallel op hands it a fixed list of jobs
//! whose results do not depend on which thread runs which job or in what order, so the pool's
//! scheduling never changes a result.
//!
//! A pool of `threads` has `threads − 1` workers; the calling thread takes jobs too. Ops come
//! back to back (a decode step is some 200 matmuls of tens of microseconds), so between ops a
//! worker spins on the batch counter for a while before it sleeps: waking a sleeping thread
//! costs more than most ops (a general-purpose pool that parks its workers and the caller
//! spent about 14% of a decode step in the scheduler). A batch makes the wake-up system call
//! only when some worker sleeps. An idle backend (a server between requests) therefore costs
//! no CPU once its workers have spun for [`SPIN`] (`KVSERVE_CPU_SPIN_US`).

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use std::{fmt, thread};

use crate::error::{AttentionError, Result};

/// How long an idle worker spins for the next batch before it sleeps, unless
/// `KVSERVE_CPU_SPIN_US` (microseconds) says otherwise.
const SPIN: Duration = Duration::from_millis(2);

/// The spin length: `KVSERVE_CPU_SPIN_US` if set to a number, else [`SPIN`].
fn spin_from_env() -> Duration {
    std::env::var("KVSERVE_CPU_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map_or(SPIN, Duration::from_micros)
}

/// A job of the current batch, its lifetime erased (see [`Pool::run`]).
type Job = &'static (dyn Fn(usize) + Sync);

/// The batch the workers take jobs from.
#[derive(Default)]
struct Batch {
    job: Option<Job>,
    count: usize,
}

/// What the caller and the workers share.
#[derive(Default)]
struct Shared {
    batch: Mutex<Batch>,
    /// Signalled (under `batch`) when a batch is published or the pool shuts down, if a
    /// worker sleeps on it.
    wake: Condvar,
    /// Workers waiting on `wake` (changed under `batch`): a batch published while none is
    /// sleeps needs no wake-up call (a system call each).
    sleepers: AtomicUsize,
    /// How long an idle worker spins before it sleeps.
    spin: Duration,
    /// Bumped (under `batch`) for every published batch.
    generation: AtomicU64,
    /// The next job index to claim, and the jobs finished, of the current batch.
    next: AtomicUsize,
    done: AtomicUsize,
    /// Workers between seeing a batch and leaving it.
    active: AtomicUsize,
    /// A job of the current batch panicked (the caller re-raises it).
    panicked: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    shutdown: AtomicBool,
}

impl Shared {
    fn lock_batch(&self) -> MutexGuard<'_, Batch> {
        self.batch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Claims and runs jobs of the batch (`job`, `count`) until none is left.
    fn work(&self, job: Job, count: usize) {
        loop {
            let i = self.next.fetch_add(1, Ordering::AcqRel);
            if i >= count {
                return;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| job(i))) {
                *self.panicked.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
            }
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// A worker: waits for each new batch (spinning, then sleeping) and works on it.
    fn worker(&self) {
        let mut seen = self.generation.load(Ordering::Acquire);
        loop {
            let start = Instant::now();
            let mut spins = 0u32;
            while self.generation.load(Ordering::Acquire) == seen {
                if self.shutdown.load(Ordering::Acquire) {
                    return;
                }
                std::hint::spin_loop();
                spins += 1;
                if spins % 1024 == 0 && start.elapsed() >= self.spin {
                    let mut b = self.lock_batch();
                    self.sleepers.fetch_add(1, Ordering::Relaxed);
                    while self.generation.load(Ordering::Acquire) == seen
                        && !self.shutdown.load(Ordering::Acquire)
                    {
                        b = self.wake.wait(b).unwrap_or_else(|e| e.into_inner());
                    }
                    self.sleepers.fetch_sub(1, Ordering::Relaxed);
                }
            }
            // Announce before reading the batch, so the caller waits for us (see `run`).
            self.active.fetch_add(1, Ordering::AcqRel);
            let (job, count, generation) = {
                let b = self.lock_batch();
                (b.job, b.count, self.generation.load(Ordering::Acquire))
            };
            seen = generation;
            if let Some(job) = job {
                self.work(job, count);
            }
            self.active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The workers; joined when the last clone of the pool is dropped.
struct Workers {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    /// One batch at a time: a second caller (another thread on a clone of the backend, or a
    /// job calling back into the pool) runs its jobs on its own thread instead.
    submit: Mutex<()>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        {
            let _b = self.shared.lock_batch();
            self.shared.shutdown.store(true, Ordering::Release);
            self.shared.wake.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// `threads` threads: the caller and `threads − 1` workers.
#[derive(Clone)]
pub(crate) struct Pool {
    threads: usize,
    workers: Option<Arc<Workers>>,
}

impl Default for Pool {
    fn default() -> Self {
        Pool {
            threads: 1,
            workers: None,
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
    /// A pool of `threads` threads (`≥ 1`; one runs everything on the caller).
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
        let shared = Arc::new(Shared {
            spin: spin_from_env(),
            ..Shared::default()
        });
        let mut handles = Vec::with_capacity(threads - 1);
        for i in 1..threads {
            let s = Arc::clone(&shared);
            let h = thread::Builder::new()
                .name(format!("kvserve-cpu-{i}"))
                .spawn(move || s.worker())
                .map_err(|e| AttentionError::InvalidConfig {
                    field: "threads",
                    reason: format!("cannot start {threads} worker threads: {e}"),
                });
            match h {
                Ok(h) => handles.push(h),
                Err(e) => {
                    // Stop the ones already started.
                    drop(Workers {
                        shared,
                        handles,
                        submit: Mutex::new(()),
                    });
                    return Err(e);
                }
            }
        }
        Ok(Pool {
            threads,
            workers: Some(Arc::new(Workers {
                shared,
                handles,
                submit: Mutex::new(()),
            })),
        })
    }

    /// The number of threads (the caller's included).
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `job` on every item and returns when all have run: spread over the pool's threads
    /// (the caller's included) when there are several items, else on the calling thread. A
    /// panicking job is re-raised here once every job has finished.
    pub(crate) fn for_each<T: Send>(&self, items: Vec<T>, job: impl Fn(T) + Sync) {
        let workers = match &self.workers {
            Some(w) if items.len() > 1 => w,
            _ => return items.into_iter().for_each(job),
        };
        let Ok(_one_batch) = workers.submit.try_lock() else {
            return items.into_iter().for_each(job);
        };
        let count = items.len();
        let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
        let run = |i: usize| {
            let item = slots[i].lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(item) = item {
                job(item);
            }
        };
        Self::run(&workers.shared, &run, count);
    }

    /// Publishes the batch `job(0 .. count)`, works on it, and returns once every job has run
    /// and no worker holds `job` any more.
    fn run(s: &Shared, job: &(dyn Fn(usize) + Sync), count: usize) {
        // SAFETY: the erased reference is only used while this call is on the stack: it is
        // published in `s.batch`, and before returning (panics are caught, so unwinding cannot
        // skip this) the call waits until every job has finished, removes it from `s.batch`,
        // then waits until no worker that may have read it (they announce themselves in
        // `active` before reading `s.batch`) is still using it. A worker that announces itself
        // later reads `None` or a later batch.
        let erased: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(job) };
        {
            let mut b = s.lock_batch();
            s.next.store(0, Ordering::Release);
            s.done.store(0, Ordering::Release);
            b.job = Some(erased);
            b.count = count;
            s.generation.fetch_add(1, Ordering::AcqRel);
            if s.sleepers.load(Ordering::Relaxed) > 0 {
                s.wake.notify_all();
            }
        }
        s.work(erased, count);
        while s.done.load(Ordering::Acquire) < count {
            std::hint::spin_loop();
        }
        s.lock_batch().job = None;
        while s.active.load(Ordering::Acquire) > 0 {
            std::hint::spin_loop();
        }
        if let Some(p) = s.panicked.lock().unwrap_or_else(|e| e.into_inner()).take() {
            resume_unwind(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

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

    /// Every item runs exactly once, on up to `threads` distinct threads, for any count, over
    /// many batches in a row (late workers never see a finished batch's jobs).
    #[test]
    fn every_item_runs_once() {
        for threads in 1..=3 {
            let pool = Pool::new(threads).unwrap();
            assert_eq!(pool.threads(), threads);
            for round in 0..300 {
                let items = round % 9;
                let hits: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
                let names = Mutex::new(HashSet::new());
                pool.for_each((0..items).collect(), |i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                    names.lock().unwrap().insert(thread::current().id());
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                assert!(names.lock().unwrap().len() <= threads);
            }
        }
    }

    /// Workers that went to sleep wake up for the next batch.
    #[test]
    fn sleeping_workers_wake_up() {
        let pool = Pool::new(3).unwrap();
        let shared = &pool.workers.as_ref().unwrap().shared;
        let spin = shared.spin;
        for _ in 0..2 {
            // Both workers spin out and sleep (counted, so the next batch wakes them).
            let start = Instant::now();
            while shared.sleepers.load(Ordering::Relaxed) < 2 {
                assert!(
                    start.elapsed() < spin + Duration::from_secs(10),
                    "workers never slept"
                );
                thread::sleep(spin / 4 + Duration::from_micros(50));
            }
            let hits = AtomicUsize::new(0);
            pool.for_each(vec![1, 2, 3, 4], |v| {
                hits.fetch_add(v, Ordering::Relaxed);
            });
            assert_eq!(hits.load(Ordering::Relaxed), 10);
        }
        thread::sleep(SPIN * 3);
        let hits = AtomicUsize::new(0);
        pool.for_each(vec![1, 2, 3, 4], |v| {
            hits.fetch_add(v, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 10);
    }

    /// A panicking job is re-raised on the caller after the others ran, and the pool still
    /// works afterwards; a job that calls back into the pool runs its items in place.
    #[test]
    fn panics_propagate_and_nested_batches_run_in_place() {
        let pool = Pool::new(3).unwrap();
        let ran = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.for_each((0..6).collect(), |i| {
                ran.fetch_add(1, Ordering::Relaxed);
                assert!(i != 3, "job 3 fails");
            })
        }));
        assert!(r.is_err());
        assert_eq!(ran.load(Ordering::Relaxed), 6);
        let sum = AtomicUsize::new(0);
        pool.for_each(vec![10, 20], |a| {
            pool.for_each(vec![1, 2], |b| {
                sum.fetch_add(a * b, Ordering::Relaxed);
            })
        });
        assert_eq!(sum.load(Ordering::Relaxed), 90);
    }
}
