//! KV pool sizing for `--mem-fraction-static`: SGLang's rule ([`kv_pool::MemoryPlan`]) over the
//! memory the backend computes in. The CPU backend (and wgpu on a software adapter) computes in
//! host memory, measured from `/proc/meminfo`; the weights are counted by their checkpoint
//! size (the built-in tiny preset's by its parameter count).

use kv_pool::{KvShape, MemoryPlan, MemoryPlanInput};

use crate::bench::ModelSource;
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
    let plan = MemoryPlan::compute(MemoryPlanInput {
        total_device_bytes: total,
        free_after_weights_bytes: available.saturating_sub(weights).min(total),
        mem_fraction_static,
        shape,
        page_size,
        context_len,
        max_total_tokens,
        max_running_requests: None,
    })
    .map_err(|e| EngineError::arg("--mem-fraction-static", e.to_string()))?;
    Ok(plan)
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
}
