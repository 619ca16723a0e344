//! KV pool sizing: every pool size and default request limit the engine uses comes from SGLang's
//! rule, [`kv_pool::MemoryPlan`], never from a formula of its own.
//! - `bench` and `serve` with `--mem-fraction-static`: over the memory the backend computes in.
//!   The CPU backend computes in host memory ([`pool_tokens`]), measured from `/proc/meminfo`
//!   before the weights load, which are counted by their checkpoint size (the built-in tiny
//!   preset's by its parameter count). A GPU backend (cuda, rocm) reports its device's memory,
//!   measured once the weights are on it, as SGLang's `profile_max_num_token` does
//!   ([`device_pool_plan`]).
//! - `sim` ([`simulated_plan`], [`given_pool_plan`]): over the cost model's accelerators, or
//!   for a pool size given on the command line.

use kv_pool::{floor_to_page, KvDtype, KvShape, MemoryPlan, MemoryPlanInput};
use scheduler::CostModel;

use super::source::ModelSource;
use crate::error::{EngineError, Result};

/// Host memory in bytes: `(MemTotal, MemAvailable)` from `/proc/meminfo`.
pub fn host_memory() -> Result<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|e| {
        EngineError::arg(
            "--mem-fraction-static",
            format!("cannot measure host memory (/proc/meminfo: {e}); give --max-total-tokens"),
        )
    })?;
    parse_meminfo(&text).ok_or_else(|| {
        EngineError::arg(
            "--mem-fraction-static",
            "cannot read MemTotal and MemAvailable from /proc/meminfo; give --max-total-tokens",
        )
    })
}

/// `(MemTotal, MemAvailable)` in bytes from the text of `/proc/meminfo`.
fn parse_meminfo(text: &str) -> Option<(u64, u64)> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        kib.checked_mul(1024)
    };
    Some((field("MemTotal:")?, field("MemAvailable:")?))
}

/// Bytes of the model's weights: the checkpoint's `*.safetensors` files, or the tiny preset's
/// parameters in f32.
pub fn weight_bytes(model: &ModelSource) -> Result<u64> {
    match model {
        ModelSource::Tiny => Ok(model::tiny::tiny_config().num_parameters() as u64 * 4),
        ModelSource::Path(dir) => {
            let io = |source| EngineError::Io {
                path: dir.display().to_string(),
                source,
            };
            let mut total = 0;
            for entry in std::fs::read_dir(dir).map_err(io)? {
                let path = entry.map_err(io)?.path();
                if path.extension().is_some_and(|e| e == "safetensors") {
                    total += std::fs::metadata(&path).map_err(io)?.len();
                }
            }
            Ok(total)
        }
    }
}

/// SGLang's memory plan for `mem_fraction_static` of host memory after the weights, capped by
/// `max_total_tokens` when given; its `max_total_num_tokens` is the pool size.
pub fn pool_tokens(
    mem_fraction_static: f64,
    model: &ModelSource,
    shape: KvShape,
    page_size: u32,
    context_len: usize,
    max_total_tokens: Option<usize>,
) -> Result<MemoryPlan> {
    let (total, available) = host_memory()?;
    let weights = weight_bytes(model)?;
    plan_after_weights(
        total,
        available.saturating_sub(weights).min(total),
        mem_fraction_static,
        shape,
        page_size,
        context_len,
        max_total_tokens,
    )
}

/// SGLang's memory plan for `mem_fraction_static` of a device's memory, `memory` measured once
/// the weights are on it (`profile_max_num_token`: the pool takes what is free beyond the
/// `1 − mem_fraction_static` of the device left for activations and graphs), capped by
/// `max_total_tokens` when given.
pub fn device_pool_plan(
    mem_fraction_static: f64,
    memory: attention::DeviceMemory,
    shape: KvShape,
    page_size: u32,
    context_len: usize,
    max_total_tokens: Option<usize>,
) -> Result<MemoryPlan> {
    plan_after_weights(
        memory.total_bytes,
        memory.free_bytes.min(memory.total_bytes),
        mem_fraction_static,
        shape,
        page_size,
        context_len,
        max_total_tokens,
    )
}

/// [`MemoryPlan::compute`] over `total` bytes of which `free_after_weights` are free once the
/// weights are loaded; an error names `--mem-fraction-static`.
fn plan_after_weights(
    total: u64,
    free_after_weights: u64,
    mem_fraction_static: f64,
    shape: KvShape,
    page_size: u32,
    context_len: usize,
    max_total_tokens: Option<usize>,
) -> Result<MemoryPlan> {
    MemoryPlan::compute(MemoryPlanInput {
        total_device_bytes: total,
        free_after_weights_bytes: free_after_weights,
        mem_fraction_static,
        shape,
        page_size,
        context_len,
        max_total_tokens,
        max_running_requests: None,
    })
    .map_err(|e| EngineError::arg("--mem-fraction-static", e.to_string()))
}

/// `tokens` in whole pages of `page_size`: the pool the allocator gets. Less than one page is an
/// error naming `--max-total-tokens`.
pub fn whole_pages(tokens: usize, page_size: u32) -> Result<usize> {
    let capacity = floor_to_page(tokens, page_size as usize);
    if capacity == 0 {
        return Err(EngineError::arg(
            "--max-total-tokens",
            format!("{tokens} tokens is less than one page of {page_size}"),
        ));
    }
    Ok(capacity)
}

/// The KV shape of the cost model's model: its KV heads, head dimension and layers, stored in
/// the weights' dtype (the presets are bf16).
pub fn cost_model_kv_shape(cost: &CostModel) -> Result<KvShape> {
    let m = &cost.model;
    let dtype = match m.weight_bytes as u32 {
        1 => KvDtype::Fp8E4m3,
        2 => KvDtype::Bf16,
        4 => KvDtype::F32,
        _ => {
            return Err(EngineError::arg(
                "--model",
                format!("{}: no KV dtype of {} bytes", m.name, m.weight_bytes),
            ))
        }
    };
    let shape = KvShape::mha(m.kv_heads, m.head_dim, m.head_dim, m.layers, dtype)
        .map_err(|e| EngineError::arg("--model", e.to_string()))?;
    if shape.cell_size() != m.kv_bytes_per_token {
        return Err(EngineError::arg(
            "--model",
            format!(
                "{}: kv_bytes_per_token {} is not its shape's {} bytes per token",
                m.name,
                m.kv_bytes_per_token,
                shape.cell_size()
            ),
        ));
    }
    Ok(shape)
}

/// SGLang's memory plan on the cost model's device: its `tp` accelerators' memory as one device
/// with the whole model's weights loaded and the whole model's KV per token (the same pool as
/// splitting both over `tp` devices, with KV heads divisible by `tp`).
pub fn simulated_plan(
    cost: &CostModel,
    mem_fraction_static: f64,
    page_size: u32,
    context_len: usize,
    max_running_requests: Option<usize>,
) -> Result<MemoryPlan> {
    let total = (cost.accel.mem_bytes * cost.tp as f64) as u64;
    let weights = (cost.model.params * cost.model.weight_bytes) as u64;
    MemoryPlan::compute(MemoryPlanInput {
        total_device_bytes: total,
        free_after_weights_bytes: total.saturating_sub(weights),
        mem_fraction_static,
        shape: cost_model_kv_shape(cost)?,
        page_size,
        context_len,
        max_total_tokens: None,
        max_running_requests,
    })
    .map_err(|e| {
        EngineError::arg(
            "--mem-fraction-static",
            format!(
                "{} on {} × {}: {e}; or give --max-total-tokens",
                cost.model.name, cost.tp, cost.accel.name
            ),
        )
    })
}

/// SGLang's memory plan for a pool of `capacity` tokens given on the command line (`kvserve sim
/// --max-total-tokens`): a device that holds exactly that pool, so the pool is `capacity` in
/// whole pages and the request limit follows SGLang's rule for it.
pub fn given_pool_plan(
    shape: KvShape,
    capacity: usize,
    page_size: u32,
    context_len: usize,
    max_running_requests: Option<usize>,
) -> Result<MemoryPlan> {
    let bytes = (capacity as u64)
        .checked_mul(shape.cell_size() as u64)
        .ok_or_else(|| {
            EngineError::arg(
                "--max-total-tokens",
                format!("{capacity} tokens is too many"),
            )
        })?;
    MemoryPlan::compute(MemoryPlanInput {
        total_device_bytes: bytes.max(1),
        free_after_weights_bytes: bytes.max(1),
        mem_fraction_static: 1.0,
        shape,
        page_size,
        context_len,
        max_total_tokens: Some(capacity),
        max_running_requests,
    })
    .map_err(|e| EngineError::arg("--max-total-tokens", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields_in_bytes() {
        let text = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(
            parse_meminfo(text),
            Some((24_576_000 * 1024, 20_000_000 * 1024))
        );
        assert_eq!(parse_meminfo("MemTotal: x kB\n"), None);
    }

    fn llama3_8b() -> KvShape {
        KvShape::mha(8, 128, 128, 32, KvDtype::Bf16).unwrap()
    }

    #[test]
    fn default_request_limit_as_sglang() {
        let limit = |capacity, context_len| {
            given_pool_plan(llama3_8b(), capacity, 1, context_len, None)
                .unwrap()
                .max_running_requests()
        };
        assert_eq!(limit(441_536, 8192), 4096);
        assert_eq!(limit(100_000, 131_072), 2048);
        assert_eq!(limit(1000, 8192), 500);
        // A given pool is used as given, in whole pages; a user limit is capped at half of it.
        let p = given_pool_plan(llama3_8b(), 1000, 16, 8192, Some(600)).unwrap();
        assert_eq!(
            (p.max_total_num_tokens(), p.max_running_requests()),
            (992, 496)
        );
        assert!(given_pool_plan(llama3_8b(), 8, 16, 8192, None).is_err());
    }

    #[test]
    fn a_device_pool_is_what_the_fraction_leaves_free_after_the_weights() {
        // An 80 GiB device with 64 GiB free once the weights are loaded, at 0.88: the pool
        // takes 64 − 80 · 0.12 = 54.4 GiB, 445,644 tokens of Llama-3-8B's 128 KiB.
        let gib = 1u64 << 30;
        let memory = attention::DeviceMemory {
            free_bytes: 64 * gib,
            total_bytes: 80 * gib,
        };
        let p = device_pool_plan(0.88, memory, llama3_8b(), 16, 8192, None).unwrap();
        let want = ((64.0 - 80.0 * 0.12) * gib as f64 / (128.0 * 1024.0)) as usize;
        assert!(
            p.max_total_num_tokens().abs_diff(want) < 16,
            "{} vs {want}",
            p.max_total_num_tokens()
        );
        // A cap wins; a fraction that leaves nothing for the pool is an error naming the flag.
        let capped = device_pool_plan(0.88, memory, llama3_8b(), 16, 8192, Some(1000)).unwrap();
        assert_eq!(capped.max_total_num_tokens(), 992);
        let e = device_pool_plan(0.1, memory, llama3_8b(), 16, 8192, None).unwrap_err();
        assert!(e.to_string().contains("--mem-fraction-static"), "{e}");
    }

    #[test]
    fn simulated_device_as_the_cost_model_sized_it() {
        use scheduler::{Accelerator, ModelShape};
        // Llama-3-8B on one H100 at 0.88: (80 GB × 0.88 − 16.06 GB) / 128 KiB = 414,581 tokens.
        let cost = CostModel::new(ModelShape::LLAMA3_8B, Accelerator::H100, 1);
        let p = simulated_plan(&cost, 0.88, 1, 8192, None).unwrap();
        assert_eq!(p.max_total_num_tokens(), 414_581);
        assert_eq!(p.max_running_requests(), 4096);
        // 70B does not fit one H100; four A100s hold it.
        let big = CostModel::new(ModelShape::LLAMA3_70B, Accelerator::H100, 1);
        let e = simulated_plan(&big, 0.88, 1, 8192, None).unwrap_err();
        assert!(e.to_string().contains("--mem-fraction-static"), "{e}");
        let four = CostModel::new(ModelShape::LLAMA3_70B, Accelerator::A100, 4);
        assert!(simulated_plan(&four, 0.88, 16, 8192, None).is_ok());
    }
}
