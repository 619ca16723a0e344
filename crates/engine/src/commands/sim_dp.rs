//! `kvserve sim --dp N,… --router-policy …`: every configuration of the sweep (schedule
//! policy × eviction policy × pool size per instance) as a cluster of each size behind each
//! router policy (`crate::sim_dp`); prints a table or JSON lines, optionally plots hit rate
//! and TTFT against the number of instances.

use std::io::Write;
use std::time::Instant;

use scheduler::SimRequest;

use super::output_text;
use super::{jobs, progress_bar, write_out};
use crate::cli::SimArgs;
use crate::error::{EngineError, Result};
use crate::sim::SimConfig;
use crate::sim_dp::{plot_dp, render_dp_table, run_dp_sweep, DpConfig};

/// The progress bar of `sim --dp` (clusters simulated).
const PROGRESS_DP: &str =
    "{elapsed_precise} [{bar:40}] {human_pos}/{human_len} clusters, eta {eta}";

/// `kvserve sim` with `--dp`: `configs` are the instances' settings.
pub fn sim_dp(
    args: &SimArgs,
    workload: &str,
    requests: &[SimRequest],
    configs: &[SimConfig],
    out: &mut dyn Write,
) -> Result<()> {
    let cache_aware = args.router.cache_aware()?;
    let policies = args.router.policies();
    let mut clusters = Vec::new();
    for instance in configs {
        for &dp in &args.router.dp {
            for &policy in &policies {
                clusters.push(DpConfig {
                    instance: instance.clone(),
                    dp: dp as usize,
                    policy,
                    cache_aware,
                    seed: args.router.router_seed,
                });
            }
        }
    }
    if !args.output.quiet {
        eprintln!(
            "note: {} requests ({workload}), {} clusters",
            requests.len(),
            clusters.len()
        );
    }
    let bar = progress_bar(args.output.quiet, clusters.len() as u64, PROGRESS_DP);
    let start = Instant::now();
    let outcomes = run_dp_sweep(requests, &clusters, jobs(args.output.jobs), &|| bar.inc(1));
    bar.finish_and_clear();
    let outcomes = outcomes?;
    let wall = start.elapsed().as_secs_f64();
    let table = || render_dp_table(&outcomes, !args.output.no_timings);
    let Some(first) = configs.first() else {
        return Err(EngineError::arg("--dp", "no configuration to simulate"));
    };
    let cost = &first.cost;
    let text = output_text(args, workload, requests.len(), cost, table, &outcomes, wall)?;
    write_out(out, &text)?;
    if let Some(path) = &args.plot {
        plot_dp(&outcomes, workload, path)?;
        if !args.output.quiet {
            eprintln!("note: plots written to {} (and -ttft)", path.display());
        }
    }
    Ok(())
}
