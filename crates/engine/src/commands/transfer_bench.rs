//! `kvserve transfer-bench`: KV-transfer throughput of a backend against its plain baseline
//! (`transfer::bench`, Mooncake's `transfer_engine_bench`): a text summary or one JSON object.

use std::io::Write;
use std::time::Duration;

use transfer::bench::{run_bench, BenchConfig};
use transfer::BackendKind;

use super::write_out;
use crate::cli::{OutputFormat, TransferBenchArgs};
use crate::error::{EngineError, Result};

/// `kvserve transfer-bench`.
pub fn transfer_bench(args: &TransferBenchArgs, out: &mut dyn Write) -> Result<()> {
    let backend = BackendKind::parse(&args.backend)
        .filter(|k| matches!(k, BackendKind::Tcp | BackendKind::Shm))
        .ok_or_else(|| EngineError::InvalidArgument {
            flag: "--backend",
            message: format!("{:?}: expected tcp or shm", args.backend),
        })?;
    if !(args.duration.is_finite() && args.duration > 0.0 && args.duration < 1e6) {
        return Err(EngineError::InvalidArgument {
            flag: "--duration",
            message: format!("{}: expected seconds > 0", args.duration),
        });
    }
    let cfg = BenchConfig {
        backend,
        block_size: args.block_size as usize,
        batch_size: args.batch_size as usize,
        threads: args.threads as usize,
        duration: Duration::from_secs_f64(args.duration),
    };
    let r = run_bench(&cfg).map_err(|e| EngineError::Io {
        path: "transfer-bench".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    let text = match args.format {
        OutputFormat::Json => {
            let mut s = serde_json::to_string(&r).expect("plain data serializes");
            s.push('\n');
            s
        }
        OutputFormat::Table => {
            let baseline = if backend == BackendKind::Tcp {
                "raw loopback sockets"
            } else {
                "memcpy"
            };
            let mut s = format!(
                "transfer-bench {backend}: {} blocks of {} B per batch, {} threads, {:.1} s\n",
                cfg.batch_size, cfg.block_size, cfg.threads, args.duration
            );
            s += &format!(
                "engine   {:>8.2} GB/s (median of {} rounds)\n",
                r.gbps,
                r.rounds.len()
            );
            s += &format!("baseline {:>8.2} GB/s ({baseline})\n", r.baseline_gbps);
            s += &format!("ratio    {:>8.1} %\n", 100.0 * r.ratio);
            s
        }
    };
    write_out(out, &text)
}
