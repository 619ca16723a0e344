//! `kvserve sim`: the serving simulation swept over schedule policies × eviction policies × pool
//! sizes (`crate::sim` runs it); print a table or JSON lines, optionally plot output throughput
//! against pool size. With `--enable-hierarchical-cache` the tree has a simulated host tier
//! (and L3 store) and the table adds the prompt tokens served per tier. With `--dp` the
//! configurations are clusters behind the router instead (`super::sim_dp`).

use std::io::Write;
use std::time::Instant;

use kv_pool::MemoryPlan;
use scheduler::{Accelerator, CostModel, ModelShape, SchedulerConfig};

use super::{jobs, output_text, progress_bar, write_out, PROGRESS};
use crate::cache_sim::parse_policies;
use crate::cli::{SimArgs, WorkloadDefaults};
use crate::error::{EngineError, Result};
use crate::setup::pool::{cost_model_kv_shape, given_pool_plan, simulated_plan};
use crate::sim::{parse_schedule_policies, render_table, run_sweep, sim_requests, SimConfig};
use crate::sim_contiguity::{parse_allocators, plot_fragmentation, render_contiguity_table};
use crate::sim_tier::SimTier;

/// `kvserve sim`.
pub fn sim(args: &SimArgs, out: &mut dyn Write) -> Result<()> {
    let bad =
        |flag: &'static str, e: scheduler::SchedulerError| EngineError::arg(flag, e.to_string());
    let model = ModelShape::preset(&args.model).map_err(|e| bad("--model", e))?;
    let accel = Accelerator::preset(&args.accelerator).map_err(|e| bad("--accelerator", e))?;
    let tier = args.hicache.setup()?.map(SimTier::new);
    let mut cost = CostModel::new(model, accel, args.tp);
    match &tier {
        Some(t) => cost.storage_bw = t.storage_bw(args.storage_bandwidth)?,
        None if args.storage_bandwidth.is_some() => {
            return Err(EngineError::arg(
                "--storage-bandwidth",
                "the L3 store's bandwidth needs --enable-hierarchical-cache and \
                 --hicache-storage-backend",
            ))
        }
        None => {}
    }
    if tier.is_some() && args.disable_radix_cache {
        return Err(EngineError::arg(
            "--enable-hierarchical-cache",
            "the host tier keeps radix-tree nodes: it cannot be used with --disable-radix-cache",
        ));
    }
    if !(args.mem_fraction_static > 0.0 && args.mem_fraction_static <= 1.0) {
        return Err(EngineError::arg(
            "--mem-fraction-static",
            format!("{} is not in (0, 1]", args.mem_fraction_static),
        ));
    }
    let schedule_policies = parse_schedule_policies(&args.schedule_policy)?;
    let eviction_policies: Vec<String> = if args.disable_radix_cache {
        vec!["disabled".into()]
    } else {
        parse_policies(&args.radix_eviction_policy)?
            .into_iter()
            .map(|p| p.to_string())
            .collect()
    };
    let workload = args.source.load(WorkloadDefaults::SGLANG)?;
    let arrivals = args.arrivals.arrivals(&args.source, None)?;
    let requests = sim_requests(&workload, arrivals)?;
    let longest = workload.longest_request();
    let context_len = args.context_length.unwrap_or(longest + 1);
    // Every pool size and request limit through SGLang's rule (`setup/pool.rs`).
    let plans: Vec<MemoryPlan> = if args.max_total_tokens.is_empty() {
        vec![simulated_plan(
            &cost,
            args.mem_fraction_static,
            args.page_size,
            context_len,
            args.max_running_requests,
        )?]
    } else {
        let shape = cost_model_kv_shape(&cost)?;
        args.max_total_tokens
            .iter()
            .map(|&capacity| {
                given_pool_plan(
                    shape,
                    capacity,
                    args.page_size,
                    context_len,
                    args.max_running_requests,
                )
            })
            .collect::<Result<_>>()?
    };
    let chunk = (args.chunked_prefill_size > 0).then_some(args.chunked_prefill_size as usize);
    let allocators: Vec<Option<_>> = match &args.allocator {
        None => vec![None],
        Some(list) => parse_allocators(list)?.into_iter().map(Some).collect(),
    };
    let mut configs = Vec::new();
    for &policy in &schedule_policies {
        for eviction in &eviction_policies {
            for plan in &plans {
                for &allocator in &allocators {
                    configs.push(SimConfig {
                        scheduler: SchedulerConfig {
                            page_size: args.page_size,
                            context_len,
                            max_running_requests: plan.max_running_requests(),
                            max_prefill_tokens: args.max_prefill_tokens,
                            chunked_prefill_size: chunk,
                            schedule_policy: policy,
                            lpm_fallback_threshold: args.lpm_fallback_threshold,
                            schedule_conservativeness: args.schedule_conservativeness,
                            enable_mixed_chunk: args.enable_mixed_chunk,
                            strict: args.check,
                            seed: args.source.seed,
                            ..SchedulerConfig::default()
                        },
                        eviction_policy: if args.disable_radix_cache {
                            "lru".into()
                        } else {
                            eviction.clone()
                        },
                        radix: !args.disable_radix_cache,
                        capacity_tokens: plan.max_total_num_tokens(),
                        cost: cost.clone(),
                        max_concurrency: args.arrivals.max_concurrency.map(|n| n as usize),
                        tier: tier.clone(),
                        allocator,
                    });
                }
            }
        }
    }
    if !args.router.dp.is_empty() {
        return super::sim_dp::sim_dp(args, &workload.name, &requests, &configs, out);
    }
    if !args.output.quiet {
        eprintln!(
            "note: {} requests ({}), {} configurations, {} on {} × {}, context {context_len}",
            requests.len(),
            workload.name,
            configs.len(),
            cost.model.name,
            args.tp,
            cost.accel.name
        );
    }
    let jobs = jobs(args.output.jobs);
    let bar = progress_bar(
        args.output.quiet,
        (requests.len() * configs.len()) as u64,
        PROGRESS,
    );
    let start = Instant::now();
    let outcomes = run_sweep(&requests, &configs, jobs, &|n| bar.inc(n as u64));
    bar.finish_and_clear();
    let outcomes = outcomes?;
    let wall = start.elapsed().as_secs_f64();
    let table = || {
        let mut t = render_table(&outcomes, !args.output.no_timings);
        if args.allocator.is_some() {
            t.push_str(&format!(
                "\nallocator contiguity (page size {}; transfer blocks per region; free runs \
                 averaged over samples every {} steps; long_runs: share of free pages in runs >= {} tokens, over samples with free pages)\n",
                args.page_size,
                crate::sim_contiguity::SAMPLE_EVERY_STEPS,
                crate::sim_contiguity::LONG_RUN_TOKENS
            ));
            t.push_str(&render_contiguity_table(&contiguity_rows(&outcomes)));
        }
        t
    };
    let text = output_text(
        args,
        &workload.name,
        requests.len(),
        &cost,
        table,
        &outcomes,
        wall,
    )?;
    write_out(out, &text)?;
    if let Some(path) = &args.contiguity_plot {
        plot_fragmentation(
            &contiguity_rows(&outcomes),
            &workload.name,
            args.page_size,
            path,
        )?;
        if !args.output.quiet {
            eprintln!("note: contiguity plot written to {}", path.display());
        }
    }
    if let Some(path) = &args.plot {
        let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for o in &outcomes {
            let label = format!("{} / {}", o.schedule_policy, o.eviction_policy);
            let point = (o.capacity_tokens as f64, o.output_tokens_per_s);
            match series.iter_mut().find(|(l, _)| *l == label) {
                Some((_, points)) => points.push(point),
                None => series.push((label, vec![point])),
            }
        }
        crate::plot::plot_lines(
            &crate::plot::LinePlot {
                title: format!(
                    "Simulated output throughput ({} on {} × {})",
                    cost.model.name, args.tp, cost.accel.name
                ),
                subtitle: workload.name.clone(),
                x_desc: format!("KV pool (tokens, page size {})", args.page_size),
                y_desc: "output tokens/s".into(),
                y_percent: false,
                x_log: true,
                series,
            },
            path,
        )?;
        if !args.output.quiet {
            eprintln!("note: plot written to {}", path.display());
        }
    }
    Ok(())
}

/// The contiguity table's rows: every measured outcome, labelled by what else varies.
fn contiguity_rows(
    outcomes: &[crate::sim::SimOutcome],
) -> Vec<crate::sim_contiguity::ContiguityRow<'_>> {
    outcomes
        .iter()
        .filter_map(|o| {
            let c = o.contiguity.as_ref()?;
            Some(crate::sim_contiguity::ContiguityRow {
                label: format!(
                    "{}/{}/{}",
                    o.schedule_policy, o.eviction_policy, o.capacity_tokens
                ),
                outcome: c,
            })
        })
        .collect()
}
