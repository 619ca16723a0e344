//! One module per subcommand, each holding that command's body: it reads the parsed flags of
//! `crate::cli`, builds what it needs through `crate::setup` or the library modules
//! (`crate::cache_sim`, `crate::sim`, `crate::workload`), and writes results to `out`, notes and
//! progress to stderr. [`run`] dispatches a parsed command line.

pub mod bench;
pub mod cache_sim;
pub mod info;
pub mod router;
pub mod serve;
pub mod sim;
pub mod sim_dp;
pub mod transfer_bench;

use std::io::{IsTerminal, Write};

use indicatif::{ProgressBar, ProgressStyle};

use crate::cli::{Cli, Command};
use crate::error::{EngineError, Result};

/// Runs a parsed command line, writing results to `out` and notes and progress to stderr.
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<()> {
    match cli.command {
        Command::CacheSim(args) => cache_sim::cache_sim(&args, out),
        Command::Sim(args) => sim::sim(&args, out),
        Command::Bench(args) => bench::bench(&args, out),
        Command::Serve(args) => serve::serve(&args),
        Command::Info(args) => info::info(&args, out),
        Command::Router(args) => router::router(&args),
        Command::TransferBench(args) => transfer_bench::transfer_bench(&args, out),
    }
}

/// The progress bar of `cache-sim` and `sim` (requests replayed over all configurations).
const PROGRESS: &str = "{elapsed_precise} [{bar:40}] {human_pos}/{human_len} requests, eta {eta}";

/// A progress bar of `len` steps on stderr in `template` (indicatif's syntax), hidden with
/// `--quiet` or when stderr is not a terminal.
fn progress_bar(quiet: bool, len: u64, template: &str) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Writes a command's result to `out` and flushes it.
fn write_out(out: &mut dyn Write, text: &str) -> Result<()> {
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|source| EngineError::Io {
            path: "standard output".into(),
            source,
        })
}

/// `--jobs`, or the available cores.
fn jobs(flag: Option<u32>) -> usize {
    flag.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |j| j as usize,
    )
}

/// The output of `sim` (also with `--dp`): a header and `table()` with the total wall time,
/// or one JSON line per item of `json`.
fn output_text<T: serde::Serialize>(
    args: &crate::cli::SimArgs,
    workload: &str,
    requests: usize,
    cost: &scheduler::CostModel,
    table: impl FnOnce() -> String,
    json: &[T],
    wall: f64,
) -> Result<String> {
    Ok(match args.output.format {
        crate::cli::OutputFormat::Table => {
            let mut t = format!(
                "workload: {workload}\n{requests} requests, {} on {} × {} (tp {}), page size {}\n",
                cost.model.name, args.tp, cost.accel.name, args.tp, args.page_size
            );
            t.push_str(&table());
            if !args.output.no_timings {
                t.push_str(&format!(
                    "total wall time {wall:.2} s for {} configurations\n",
                    json.len()
                ));
            }
            t
        }
        crate::cli::OutputFormat::Json => json
            .iter()
            .map(|o| serde_json::to_string(o).map(|l| l + "\n"))
            .collect::<std::result::Result<String, _>>()
            .map_err(|e| EngineError::arg("--format", e.to_string()))?,
    })
}
