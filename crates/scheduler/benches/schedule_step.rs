//! CPU time of one scheduling step with 256 running requests and about 1,000 waiting.
//!
//! `cargo bench -p scheduler --bench schedule_step`
//!
//! Steady state: 256 requests decode (their lengths staggered so some finish every step), and
//! the waiting queue is topped up to 1,000 after every step; prompts of 256 tokens share
//! 192-token prefixes in 16 groups, so the cache-aware policies have real matching to do. The
//! executor is the fake model, so the time is the scheduler's (queue ordering, admission
//! budgets, allocation, cache inserts, finish processing). Policies: `lpm` over the whole queue
//! (fallback threshold raised above 1,000), `lpm` with SGLang's default fallback to FCFS above
//! 128 waiting, and `fcfs`.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kv_pool::PagedAllocator;
use radix_cache::{BuiltinPolicy, RadixCache};
use scheduler::{FakeExecutor, SamplingLimits, SchedulePolicy, Scheduler, SchedulerConfig};

const RUNNING: usize = 256;
const WAITING: usize = 1000;

struct Load {
    next: u64,
}

impl Load {
    fn prompt(&mut self) -> Vec<u32> {
        let n = self.next;
        self.next += 1;
        let group = (n % 16) as u32;
        let mut p: Vec<u32> = (0..192).map(|i| 1 + group * 1000 + i).collect();
        p.extend((0..64).map(|i| 50_000 + (n as u32 % 100_000) * 64 + i));
        p
    }
}

fn scheduler(
    policy: SchedulePolicy,
    fallback: usize,
) -> (Scheduler<RadixCache, PagedAllocator>, Load) {
    let cfg = SchedulerConfig {
        page_size: 16,
        context_len: 4096,
        max_running_requests: RUNNING,
        schedule_policy: policy,
        lpm_fallback_threshold: fallback,
        chunked_prefill_size: Some(8192),
        ..SchedulerConfig::default()
    };
    let pool = 256 * 1024;
    let cache = RadixCache::new(16, BuiltinPolicy::Lru);
    let mut s = Scheduler::new(cfg, cache, PagedAllocator::new(pool, 16).unwrap()).unwrap();
    let mut load = Load { next: 0 };
    let mut e = FakeExecutor {
        vocab: 32_000,
        seed: 1,
    };
    // Fill the running batch with staggered output lengths, then the queue.
    for i in 0..RUNNING {
        s.add_request(load.prompt(), SamplingLimits::max_new(64 + i % 64), 0, None)
            .unwrap();
    }
    while s.num_running() < RUNNING || s.num_waiting() > 0 {
        s.step(&mut e).unwrap();
    }
    for i in 0..WAITING {
        s.add_request(load.prompt(), SamplingLimits::max_new(64 + i % 64), 0, None)
            .unwrap();
    }
    (s, load)
}

fn one_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("schedule_step_256_running_1000_waiting");
    for (name, policy, fallback) in [
        ("lpm", SchedulePolicy::Lpm, 10_000),
        ("lpm_default_fallback", SchedulePolicy::Lpm, 128),
        ("fcfs", SchedulePolicy::Fcfs, 128),
    ] {
        let (mut s, mut load) = scheduler(policy, fallback);
        let mut e = FakeExecutor {
            vocab: 32_000,
            seed: 1,
        };
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for i in 0..iters {
                    let t = Instant::now();
                    s.step(&mut e).unwrap();
                    total += t.elapsed();
                    s.take_finished();
                    // Keep about 1,000 waiting (outside the timing).
                    while s.num_waiting() < WAITING {
                        s.add_request(
                            load.prompt(),
                            SamplingLimits::max_new(64 + i as usize % 64),
                            0,
                            None,
                        )
                        .unwrap();
                    }
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group!(benches, one_step);
criterion_main!(benches);
