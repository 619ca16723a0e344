//! `kvserve cache-sim`: replay a workload through the prefix cache for every eviction policy and
//! capacity asked for (`crate::cache_sim` runs the replays); print a table or JSON lines,
//! optionally plot hit rate against capacity. With `--enable-hierarchical-cache`, every replay
//! has a simulated host tier (and L3 store) and reports its hit rate per tier.

use std::io::Write;
use std::time::Instant;

use super::{jobs, progress_bar, write_out, PROGRESS};
use crate::cache_sim::{page_align_capacity, parse_policies, run_sweep, SweepConfig};
use crate::cli::{CacheSimArgs, Capacity, OutputFormat, WorkloadDefaults};
use crate::error::Result;
use crate::plot::{plot_gap_closed, plot_hit_rates};
use crate::report::{render_json_lines, render_table, TableOptions};
use crate::sim_tier::SimTier;

fn note(args: &CacheSimArgs, msg: &str) {
    if !args.output.quiet {
        eprintln!("note: {msg}");
    }
}

/// `kvserve cache-sim`.
pub fn cache_sim(args: &CacheSimArgs, out: &mut dyn Write) -> Result<()> {
    let policies = parse_policies(&args.policy)?;
    let tier = args.hicache.setup()?.map(SimTier::new);
    let p = args.page_size;
    let load_start = Instant::now();
    let workload = args.source.load(WorkloadDefaults::SGLANG)?;
    let stats = workload.stats(p);
    note(
        args,
        &format!(
            "{} requests, {} prompt tokens, {} unique tokens at page size {p} ({:.2} s to prepare)",
            stats.requests,
            stats.prompt_tokens,
            stats.unique_tokens,
            load_start.elapsed().as_secs_f64()
        ),
    );

    // Capacities: as given (rounded up to pages, with a note), then fractions of the unique
    // tokens, or by default a sweep relative to them (never below the longest prompt).
    let p_tokens = p as usize;
    let unique = stats.unique_tokens.max(1) as f64;
    let longest = stats.max_prompt_tokens.div_ceil(p_tokens).max(1) * p_tokens;
    let mut capacities = Vec::new();
    let mut add = |tokens: usize| {
        if !capacities.contains(&tokens) {
            capacities.push(tokens);
        }
    };
    for c in &args.capacity_tokens {
        match *c {
            Capacity::Tokens(n) => {
                let aligned = page_align_capacity(n, p)?;
                if aligned != n {
                    note(
                        args,
                        &format!(
                            "capacity {n} rounded up to {aligned} (whole pages of {p} tokens)"
                        ),
                    );
                }
                add(aligned);
            }
            Capacity::Infinite => add(page_align_capacity(stats.never_evicting_capacity(), p)?),
        }
    }
    for f in &args.capacity_fraction {
        add(page_align_capacity(
            ((f * unique).ceil() as usize).max(1),
            p,
        )?);
    }
    if args.capacity_tokens.is_empty() && args.capacity_fraction.is_empty() {
        for d in [16.0, 8.0, 4.0, 2.0] {
            let tokens = ((unique / d).ceil() as usize).max(longest);
            add(page_align_capacity(tokens, p)?);
        }
        add(page_align_capacity(stats.never_evicting_capacity(), p)?);
    }

    let jobs = jobs(args.output.jobs);
    let cfg = SweepConfig {
        policies,
        capacities,
        page_size: p,
        check: args.check,
        jobs,
        tier,
    };
    let total = (cfg.policies.len() * cfg.capacities.len() * workload.requests.len()) as u64;
    let bar = progress_bar(args.output.quiet, total, PROGRESS);
    let start = Instant::now();
    let results = run_sweep(&workload.requests, &cfg, &|n| bar.inc(n));
    bar.finish_and_clear();
    let results = results?;
    let wall = start.elapsed().as_secs_f64();
    for r in results.iter().filter(|r| r.skipped_requests > 0) {
        note(
            args,
            &format!(
                "{} at capacity {}: skipped {} of {} requests whose prompt needs more pages \
                 than the whole pool",
                r.policy, r.capacity_tokens, r.skipped_requests, r.requests
            ),
        );
    }

    let text = match args.output.format {
        OutputFormat::Table => {
            let mut t = render_table(
                &results,
                TableOptions {
                    workload: Some((&workload.name, &stats)),
                    timings: !args.output.no_timings,
                },
            );
            if !args.output.no_timings {
                t.push_str(&format!(
                    "total wall time {wall:.2} s for {} replays on {} threads\n",
                    results.len(),
                    cfg.jobs.min(results.len())
                ));
            }
            t
        }
        OutputFormat::Json => render_json_lines(&results),
    };
    write_out(out, &text)?;
    if args.output.format == OutputFormat::Json {
        note(
            args,
            &format!("total wall time {wall:.2} s for {} replays", results.len()),
        );
    }
    if let Some(path) = &args.plot {
        plot_hit_rates(&results, &workload.name, path)?;
        note(args, &format!("plot written to {}", path.display()));
        // With `lru` and `belady` in the sweep: the gap closed, beside it (`NAME-gap.png`).
        let gap_path = gap_plot_path(path);
        if plot_gap_closed(&results, &workload.name, &gap_path)? {
            note(
                args,
                &format!("gap-closed plot written to {}", gap_path.display()),
            );
        }
    }
    Ok(())
}

/// Where the gap-closed plot goes: `plot.png` → `plot-gap.png`, beside the hit-rate plot.
fn gap_plot_path(path: &std::path::Path) -> std::path::PathBuf {
    let stem = path
        .file_stem()
        .map_or_else(|| "plot".to_string(), |s| s.to_string_lossy().into_owned());
    let ext = path
        .extension()
        .map_or_else(|| "png".to_string(), |e| e.to_string_lossy().into_owned());
    path.with_file_name(format!("{stem}-gap.{ext}"))
}
