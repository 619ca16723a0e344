//! Building an engine: the one place that turns an [`EngineSetup`] into a scheduler and a model
//! executor.
//!
//! Data flows one way: `cli` (flags) → `commands` (one module per subcommand) → `setup` (this
//! module) → the component crates. Inside it:
//! - `engine_setup`: [`EngineSetup`], the decisions of `bench` and `serve`;
//! - `source`: [`ModelSource`], the tiny preset or a Hugging Face directory;
//! - `backend`: [`BackendKind`] (`--backend`) and whether this build has it;
//! - `cuda_graph`: [`CudaGraphSetup`] (`--disable-cuda-graph`, `--cuda-graph-max-bs`) and
//!   which backends capture decode graphs;
//! - `pool`: pool sizing, always through [`kv_pool::MemoryPlan`] (host memory for the CPU
//!   backend; the simulated device for `kvserve sim`);
//! - `components`: the component kinds as enums over the compiled implementations
//!   ([`AnyRunner`], [`build_scheduler`]) and [`Inventory`] (`kvserve info`);
//! - `model_exec`: [`ModelExecutor`], the scheduler's executor over an [`AnyRunner`].

pub mod backend;
pub mod components;
pub mod cuda_graph;
pub mod engine_setup;
pub mod hicache;
pub mod model_exec;
pub mod pool;
pub mod source;

use scheduler::Scheduler;

pub use backend::BackendKind;
pub use components::{build_scheduler, AnyRunner, Inventory, PoolSize};
pub use cuda_graph::{CudaGraphSetup, GraphsOff};
pub use engine_setup::{
    default_setup, parse_policy, CudaAttentionKernel, CudaTensorCores, EngineSetup, HiCacheSetup,
};
pub use model_exec::ModelExecutor;
pub use source::ModelSource;

use crate::error::{EngineError, Result};

/// Builds the scheduler (radix or chunk cache, paged allocator) and the model executor that a
/// bench run or a server uses.
pub fn build(setup: &EngineSetup, radix: bool) -> Result<(Scheduler, ModelExecutor)> {
    let p = setup.scheduler.page_size;
    // Before any weights load: a model whose sliding window this engine does not apply is
    // served only within it.
    let config = setup.model.config()?;
    config
        .check_context_len(setup.scheduler.context_len)
        .map_err(|e| EngineError::arg("--context-length", e.to_string()))?;
    let cap = (setup.capacity_tokens != usize::MAX).then_some(setup.capacity_tokens);
    let size = match (setup.mem_fraction_static, setup.backend) {
        (None, _) => PoolSize::Slots(pool::whole_pages(setup.capacity_tokens, p)?),
        // The CPU computes in host memory, measured before the weights load.
        (Some(f), BackendKind::Cpu) => {
            let shape = config
                .kv_shape(setup.kv_dtype)
                .map_err(|e| EngineError::arg("--kv-cache-dtype", e.to_string()))?;
            let plan =
                pool::pool_tokens(f, &setup.model, shape, p, setup.scheduler.context_len, cap)?;
            PoolSize::Slots(pool::whole_pages(plan.max_total_num_tokens(), p)?)
        }
        (Some(_), BackendKind::Wgpu) => {
            return Err(EngineError::arg(
                "--mem-fraction-static",
                "wgpu does not report its adapter's memory; give --max-total-tokens for \
                 --backend wgpu",
            ))
        }
        // A GPU reports its memory, measured once the weights are on it.
        (Some(fraction), BackendKind::Cuda | BackendKind::Rocm) => {
            PoolSize::DeviceFraction { fraction, cap }
        }
    };
    let mut exec = ModelExecutor::new(AnyRunner::build(setup, size)?, setup.seed);
    let capacity = components::ModelForward::kv_capacity(exec.runner());
    let tier = match &setup.hicache {
        Some(h) if radix => {
            let parts = hicache::build_hicache(h, setup, exec.runner(), capacity)?;
            exec.set_hicache(parts.controller.handle());
            Some(components::TreeTier {
                config: parts.config,
                controller: Box::new(parts.controller),
            })
        }
        Some(_) => return Err(EngineError::arg(
            "--enable-hierarchical-cache",
            "the host tier keeps radix-tree nodes: it cannot be used with --disable-radix-cache",
        )),
        None => None,
    };
    let sched = build_scheduler(
        setup.scheduler.clone(),
        radix,
        &setup.eviction_policy,
        capacity,
        tier,
        setup.kv_events,
    )?;
    Ok((sched, exec))
}
