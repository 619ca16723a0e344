//! [`ModelExecutor`]: the scheduler's [`Executor`] over a real model. It turns the scheduler's
//! [`ForwardBatch`] into the model runner's [`ForwardInput`] (each request's new tokens and the
//! slots of all its positions, read from its row of the request-to-token table), runs the
//! forward pass, and samples one token per request that asks for one.
//!
//! Sampling is per request: [`ModelExecutor::register`] gives a request its
//! [`SamplingParams`] and prompt (for repetition penalties); unregistered requests are decoded
//! greedily. The executor keeps each registered request's generated tokens so penalties see
//! them, also across a retraction (the scheduler keeps outputs when it re-queues a request).

use std::collections::HashMap;
use std::time::Instant;

use hicache::controller::{ControllerHandle, LoadGate};
use kv_pool::{LayerWait, Page, ReqToTokenPool};
use model::{AttentionMode, ForwardInput, ForwardRequest, LogitsMode, Sampler, SamplingParams};

use super::components::{AnyRunner, ModelForward};
use crate::disagg::KvHostMirror;
use scheduler::{BatchResult, Executor, ForwardBatch, ForwardMode, ReqId, RequestFailure};

struct ReqSampling {
    sampler: Sampler,
    prompt: Vec<u32>,
    output: Vec<u32>,
}

/// The scheduler's executor over a model runner on any compiled backend.
#[doc(alias = "TpModelWorker")]
pub struct ModelExecutor {
    /// The hierarchical cache's controller, when HiCache is on: load-backs start before each
    /// forward pass, which waits for them layer by layer. Stopped before `runner` (whose KV
    /// store its IO thread copies from) is dropped.
    hicache: Option<ControllerHandle>,
    runner: AnyRunner,
    /// PD on a device backend: the host mirror of the KV store that the transfer engine moves
    /// (`None` on the `cpu` backend, whose store it moves directly, and without PD). Dropped
    /// after the PD side, as the `cpu` store is.
    kv_mirror: Option<KvHostMirror>,
    sampling: HashMap<ReqId, ReqSampling>,
    default_seed: u64,
}

impl std::fmt::Debug for ModelExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelExecutor")
            .field("backend", &self.runner.backend_name())
            .field("requests", &self.sampling.len())
            .finish()
    }
}

impl ModelExecutor {
    /// An executor over `runner`; `default_seed` seeds requests that give no seed.
    pub fn new(runner: impl Into<AnyRunner>, default_seed: u64) -> Self {
        ModelExecutor {
            hicache: None,
            runner: runner.into(),
            kv_mirror: None,
            sampling: HashMap::new(),
            default_seed,
        }
    }

    /// Starts the hierarchical cache's queued load-backs before every forward pass and makes
    /// the pass wait for them layer by layer.
    pub fn set_hicache(&mut self, handle: ControllerHandle) {
        self.hicache = Some(handle);
    }

    /// Gives request `id` its sampling parameters and prompt.
    pub fn register(
        &mut self,
        id: ReqId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> model::Result<()> {
        let seed = self.default_seed ^ id.0.wrapping_mul(kv_pool::rng::GOLDEN_GAMMA);
        let sampler = Sampler::new(params, seed)?;
        self.sampling.insert(
            id,
            ReqSampling {
                sampler,
                prompt,
                output: Vec::new(),
            },
        );
        Ok(())
    }

    /// Forgets a finished request.
    pub fn release(&mut self, id: ReqId) {
        self.sampling.remove(&id);
    }

    pub fn runner(&self) -> &AnyRunner {
        &self.runner
    }

    /// PD on a device backend: the transfer engine moves `mirror` (registered by the caller),
    /// and [`Self::stage_for_send`] / [`Self::land_received`] keep its pages current.
    pub fn set_kv_mirror(&mut self, mirror: KvHostMirror) {
        self.kv_mirror = Some(mirror);
    }

    /// Before `pages` are sent (a PD prefill server): copies them from the device store into
    /// the host mirror, after the forward passes that wrote them. Nothing to do when the
    /// transfer reads the store itself (`cpu`).
    pub fn stage_for_send(&mut self, pages: &[Page]) -> Result<(), String> {
        match &mut self.kv_mirror {
            Some(m) => m
                .to_host(pages)
                .map_err(|e| format!("staging KV pages from the device: {e}")),
            None => Ok(()),
        }
    }

    /// After `pages` were received (a PD decode server): copies them from the host mirror
    /// into the device store, ahead of any later forward pass. Nothing to do when the transfer
    /// wrote the store itself (`cpu`).
    pub fn land_received(&mut self, pages: &[Page]) -> Result<(), String> {
        match &mut self.kv_mirror {
            Some(m) => m
                .to_device(pages)
                .map_err(|e| format!("copying received KV pages to the device: {e}")),
            None => Ok(()),
        }
    }
}

impl Drop for ModelExecutor {
    fn drop(&mut self) {
        // The controller may outlive this executor (it lives in the scheduler's cache): its IO
        // thread must be done with the runner's KV store before the store is freed.
        if let Some(h) = &self.hicache {
            h.stop_io();
        }
    }
}

impl Executor for ModelExecutor {
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        rows: &ReqToTokenPool,
    ) -> Result<BatchResult, String> {
        let start = Instant::now();
        let mut requests = Vec::with_capacity(batch.len());
        let mut offset = 0;
        for k in 0..batch.len() {
            let n = batch.extend_lens[k];
            let slots = rows
                .read(batch.rows[k], batch.seq_lens[k])
                .map_err(|e| e.to_string())?;
            requests.push(ForwardRequest {
                input_ids: &batch.input_ids[offset..offset + n],
                slots,
            });
            offset += n;
        }
        let mode = if batch.mode == ForwardMode::Decode {
            AttentionMode::Decode
        } else {
            AttentionMode::Extend
        };
        // Load-backs queued at admission start now; the pass waits for each layer.
        let gate: Option<LoadGate> = self.hicache.as_ref().map(ControllerHandle::start_loads);
        let out = self
            .runner
            .forward(&ForwardInput {
                mode,
                requests,
                logits: LogitsMode::LastToken,
                layer_wait: gate.as_ref().map(|g| g as &dyn LayerWait),
            })
            .map_err(|e| e.to_string())?;
        let mut next_tokens = Vec::with_capacity(batch.len());
        let mut failed = Vec::new();
        for k in 0..batch.len() {
            let logits = out
                .last(k)
                .ok_or_else(|| format!("no logits for {}", batch.reqs[k]))?;
            if !batch.sample[k] {
                // A middle chunk samples nothing, but its last row attends every position so
                // far: non-finite logits there fail the request before the chunk's KV enters
                // the prefix cache.
                next_tokens.push(0);
                if let Err(e) = model::check_logits(logits) {
                    failed.push(RequestFailure {
                        index: k,
                        message: e.to_string(),
                    });
                }
                continue;
            }
            // A request whose logits are not finite (a NaN or an overflow in its forward) fails
            // alone; the batch's other requests keep their tokens.
            let token = match self.sampling.get_mut(&batch.reqs[k]) {
                Some(s) => s
                    .sampler
                    .sample(logits, &s.prompt, &s.output)
                    .inspect(|&t| {
                        s.output.push(t);
                    }),
                None => model::greedy(logits),
            };
            match token {
                Ok(t) => next_tokens.push(t),
                Err(e) => {
                    next_tokens.push(0);
                    failed.push(RequestFailure {
                        index: k,
                        message: e.to_string(),
                    });
                }
            }
        }
        Ok(BatchResult {
            next_tokens,
            elapsed_s: start.elapsed().as_secs_f64(),
            failed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attention::{CpuBackend, CpuConfig};
    use kv_pool::{KvDtype, KvLayout, PagedAllocator};
    use model::tiny::{random_weights, tiny_config, TINY_SEED};
    use model::{ModelConfig, TensorMap};
    use radix_cache::{BuiltinPolicy, RadixCache};
    use scheduler::{SamplingLimits, Scheduler, SchedulerConfig};

    /// The tiny preset on the CPU backend.
    fn executor() -> ModelExecutor {
        let config = tiny_config();
        executor_with(&config, &random_weights(&config, TINY_SEED))
    }

    /// A Llama-family `config` with `weights` on the CPU backend, over an f32 store of 4096
    /// slots in pages of 16.
    fn executor_with(config: &ModelConfig, weights: &TensorMap) -> ModelExecutor {
        let backend = CpuBackend::new(CpuConfig::default()).unwrap();
        let model = model::LlamaModel::load(&backend, config.clone(), weights).unwrap();
        let layout = KvLayout::new(config.kv_shape(KvDtype::F32).unwrap(), 16, 4096).unwrap();
        ModelExecutor::new(model::ModelRunner::new(backend, model, layout).unwrap(), 7)
    }

    /// A strict scheduler over pages of 16 (a 4096-slot pool, the radix cache with LRU),
    /// prefilling in chunks of `chunk` tokens.
    fn strict_scheduler(chunk: Option<usize>) -> Scheduler<RadixCache, PagedAllocator> {
        let cfg = SchedulerConfig {
            page_size: 16,
            context_len: 1024,
            chunked_prefill_size: chunk,
            strict: true,
            ..SchedulerConfig::default()
        };
        let cache = RadixCache::new(16, BuiltinPolicy::Lru);
        Scheduler::new(cfg, cache, PagedAllocator::new(4096, 16).unwrap()).unwrap()
    }

    /// Greedy outputs of the tiny model through the scheduler: the same whatever the chunk size,
    /// cache state and batch company, because the CPU backend is batch-invariant.
    #[test]
    fn greedy_output_is_independent_of_chunking_caching_and_batching() {
        let prompt: Vec<u32> = (0..150).map(|i| 100 + i * 7).collect();
        let mut outputs = Vec::new();
        for (chunk, warm, company) in [
            (None, false, 0),
            (Some(16), false, 0),
            (Some(48), true, 3),
            (None, true, 5),
        ] {
            let mut s = strict_scheduler(chunk);
            let mut e = executor();
            if warm {
                s.add_request(prompt.clone(), SamplingLimits::max_new(1), 0, None)
                    .unwrap();
                s.run_to_idle(&mut e, 100).unwrap();
                s.take_finished();
            }
            let id = s
                .add_request(prompt.clone(), SamplingLimits::max_new(12), 0, None)
                .unwrap();
            for c in 0..company {
                let other: Vec<u32> = (0..40 + c * 9).map(|i| 900 + i as u32).collect();
                s.add_request(other, SamplingLimits::max_new(5), 0, None)
                    .unwrap();
            }
            s.run_to_idle(&mut e, 500).unwrap();
            let f = s.take_finished().into_iter().find(|f| f.id == id).unwrap();
            if warm {
                assert!(f.cached_tokens >= 144, "the prompt came from the cache");
            }
            outputs.push(f.output_ids);
        }
        assert_eq!(outputs[0].len(), 12);
        assert!(outputs.iter().all(|o| *o == outputs[0]), "{outputs:?}");
    }

    #[test]
    fn registered_requests_sample_with_their_parameters() {
        let cfg = SchedulerConfig {
            page_size: 16,
            context_len: 512,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(
            cfg,
            RadixCache::new(16, BuiltinPolicy::Lru),
            PagedAllocator::new(4096, 16).unwrap(),
        )
        .unwrap();
        let mut e = executor();
        let prompt: Vec<u32> = (0..20).collect();
        let mut runs = Vec::new();
        for seed in [1, 1, 2] {
            let id = s
                .add_request(prompt.clone(), SamplingLimits::max_new(16), 0, None)
                .unwrap();
            // The tiny model is very peaked (tied random embeddings favour repeating a token): a high
            // temperature flattens it enough for seeds to matter.
            let params = SamplingParams {
                temperature: 100.0,
                seed: Some(seed),
                ..SamplingParams::default()
            };
            e.register(id, prompt.clone(), params).unwrap();
            s.run_to_idle(&mut e, 200).unwrap();
            runs.push(s.take_finished().remove(0).output_ids);
            e.release(id);
        }
        assert_eq!(runs[0], runs[1], "the same seed samples the same tokens");
        assert_ne!(runs[0], runs[2], "another seed samples other tokens");
        let bad = SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        };
        assert!(e.register(ReqId(99), prompt, bad).is_err());
    }

    /// A request whose forward gives NaN logits fails alone, with a message that says so, and
    /// its KV does not enter the prefix cache, also when its prompt is prefilled in chunks
    /// (the poisoned token is in the first of three); the request beside it in the same
    /// batches gets the tokens it gets alone. (Before, greedy sampling skipped NaN and
    /// returned token 0.)
    #[test]
    fn a_request_with_nan_logits_is_aborted_alone() {
        const POISON: u32 = 4321;
        let mut config = tiny_config();
        config.tie_word_embeddings = false;
        let mut weights = random_weights(&config, TINY_SEED);
        let mut embed = weights.remove("model.embed_tokens.weight").unwrap();
        let d = config.hidden_size;
        let row = POISON as usize * d;
        embed.data[row..row + d].fill(f32::NAN);
        weights.insert("model.embed_tokens.weight", embed).unwrap();
        let mut e = executor_with(&config, &weights);
        let clean: Vec<u32> = (0..40).map(|i| 900 + i).collect();
        let mut poisoned: Vec<u32> = (0..40).map(|i| 100 + i).collect();
        poisoned[5] = POISON;
        // Alone, the clean prompt's tokens.
        let mut s = strict_scheduler(None);
        s.add_request(clean.clone(), SamplingLimits::max_new(6), 0, None)
            .unwrap();
        s.run_to_idle(&mut e, 100).unwrap();
        let alone = s.take_finished().remove(0).output_ids;
        assert_eq!(alone.len(), 6);
        let cached_alone = s.cache().total_size();
        assert!(cached_alone >= 32, "{cached_alone}");
        // Together, greedy and sampled, whole and in chunks of 16: the poisoned one is
        // aborted, the clean one unchanged.
        for (sampled, chunk) in [(false, None), (true, None), (false, Some(16))] {
            let mut s = strict_scheduler(chunk);
            let bad = s
                .add_request(poisoned.clone(), SamplingLimits::max_new(6), 0, None)
                .unwrap();
            let good = s
                .add_request(clean.clone(), SamplingLimits::max_new(6), 0, None)
                .unwrap();
            if sampled {
                e.register(bad, poisoned.clone(), SamplingParams::default())
                    .unwrap();
            }
            s.run_to_idle(&mut e, 100).unwrap();
            s.check_invariants().unwrap();
            let done = s.take_finished();
            let f = |id| done.iter().find(|f| f.id == id).unwrap();
            match &f(bad).reason {
                scheduler::FinishReason::Abort { message } => {
                    assert!(message.contains("NaN"), "{message}")
                }
                other => {
                    panic!("sampled {sampled}, chunk {chunk:?}: expected an abort, got {other:?}")
                }
            }
            assert!(f(bad).output_ids.is_empty());
            assert_eq!(
                f(good).output_ids,
                alone,
                "sampled {sampled}, chunk {chunk:?}"
            );
            assert_eq!(
                s.cache().total_size(),
                cached_alone,
                "only the clean request's KV is cached"
            );
            e.release(bad);
        }
    }
}
