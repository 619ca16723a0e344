//! `kvserve sim --allocator`: the allocator policies compared by what they do to page
//! contiguity (issue 17). Each configuration runs with `scheduler::ContiguityProbe`; this
//! module names the policies ([`AllocatorChoice`]), counts PD transfer blocks with
//! `transfer::coalesce::page_runs` (SGLang's `group_concurrent_contiguous`), and renders the
//! figures: a table ([`render_contiguity_table`]) and free-page fragmentation over simulated
//! time ([`plot_fragmentation`]).
//!
//! The figures, per configuration: runs of consecutive pages per finished request and their
//! mean length; transfer blocks per request per region (a PD prefill sends complete pages as
//! chunks commit them; the simulated server stands in for both sides, so a block is a run on
//! both); page-table entries the passes read per page against per run; the free pages'
//! fragmentation (runs, largest run, share in runs of at least [`LONG_RUN_TOKENS`]) averaged
//! over samples taken every [`SAMPLE_EVERY_STEPS`] steps.

use std::fmt;

use kv_pool::{AnyAllocator, Page};
use scheduler::{ContiguityProbe, ContiguityReport};
use serde::Serialize;

use crate::error::{EngineError, Result};

/// Free runs of at least this many tokens count as long (in pages: this over the page size).
pub const LONG_RUN_TOKENS: usize = 2048;
/// Fragmentation is sampled every this many scheduler steps.
pub const SAMPLE_EVERY_STEPS: u64 = 16;

/// An allocator policy `--allocator` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocatorChoice {
    /// FIFO reuse (SGLang's token allocator, at any page size).
    Token,
    /// LIFO reuse (SGLang's paged allocator).
    Paged,
    /// The paged allocator in sorted-release mode (SGLang's `need_sort`, on in both PD modes).
    Sorted,
    /// Best-fit placement with growth in place (`kv_pool::BestFitAllocator`).
    BestFit,
}

impl AllocatorChoice {
    /// Every choice, in table order.
    pub const ALL: [AllocatorChoice; 4] = [
        AllocatorChoice::Token,
        AllocatorChoice::Paged,
        AllocatorChoice::Sorted,
        AllocatorChoice::BestFit,
    ];

    /// The name `--allocator` takes.
    pub fn name(self) -> &'static str {
        match self {
            AllocatorChoice::Token => "token",
            AllocatorChoice::Paged => "paged",
            AllocatorChoice::Sorted => "sorted",
            AllocatorChoice::BestFit => "best-fit",
        }
    }

    /// The allocator for `capacity` slots of `page_size`, and whether the scheduler must
    /// turn sorted release on (`SchedulerConfig::need_sort`).
    pub fn build(self, capacity: usize, page_size: u32) -> Result<(AnyAllocator, bool)> {
        let kind = match self {
            AllocatorChoice::Token => "token",
            AllocatorChoice::Paged | AllocatorChoice::Sorted => "paged",
            AllocatorChoice::BestFit => "best_fit",
        };
        let alloc = AnyAllocator::by_name(kind, capacity, page_size)?;
        Ok((alloc, self == AllocatorChoice::Sorted))
    }
}

impl fmt::Display for AllocatorChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses `--allocator`'s comma-separated list (`all`: every policy).
pub fn parse_allocators(s: &str) -> Result<Vec<AllocatorChoice>> {
    if s.trim().eq_ignore_ascii_case("all") {
        return Ok(AllocatorChoice::ALL.to_vec());
    }
    s.split(',')
        .map(|name| {
            let name = name.trim().replace('_', "-");
            AllocatorChoice::ALL
                .into_iter()
                .find(|c| c.name().eq_ignore_ascii_case(&name))
                .ok_or_else(|| {
                    EngineError::arg(
                        "--allocator",
                        format!(
                            "unknown allocator {name:?}; expected all or one of {}",
                            AllocatorChoice::ALL.map(AllocatorChoice::name).join(", ")
                        ),
                    )
                })
        })
        .collect()
}

/// PD transfer blocks of one send (per region): `transfer`'s page-run coalescing, with the
/// destination pages equal to the source pages (one simulated server stands in for both).
pub fn transfer_blocks(pages: &[Page]) -> usize {
    transfer::coalesce::page_runs(pages, pages).map_or(0, |runs| runs.len())
}

/// The probe `kvserve sim` runs for a configuration of page size `page_size`.
pub fn probe(page_size: u32) -> ContiguityProbe {
    let min_run = LONG_RUN_TOKENS.div_ceil(page_size.max(1) as usize);
    ContiguityProbe::new(page_size, min_run, SAMPLE_EVERY_STEPS, transfer_blocks)
}

/// One configuration's contiguity figures (their fields join the JSON line).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ContiguityOutcome {
    /// `--allocator`'s name for the policy.
    pub allocator: String,
    /// Finished requests measured.
    pub measured_requests: usize,
    /// Mean pages per request.
    pub pages_per_request: f64,
    /// Mean runs of consecutive pages per request.
    pub runs_per_request: f64,
    /// Mean over requests of their mean run length, in pages.
    pub mean_run_pages: f64,
    /// PD transfer blocks per request, per region (× layers × K/V for the whole transfer).
    pub transfer_blocks_per_request: f64,
    /// Page-table entries read by the passes, one per page.
    pub page_table_pages: usize,
    /// The same reads, one per run.
    pub page_table_runs: usize,
    /// Mean number of free runs over the samples.
    pub free_runs_mean: f64,
    /// Mean largest free run over the samples, in pages.
    pub largest_free_run_mean: f64,
    /// Mean share of free pages in runs of at least [`LONG_RUN_TOKENS`] tokens, over the
    /// samples with free pages (`None`: nothing was ever free when sampled).
    pub long_run_fraction_mean: Option<f64>,
    /// Fragmentation samples taken.
    pub samples: usize,
    /// The samples with free pages: (simulated seconds, free runs, share of free pages in
    /// long runs), for the plot; not in the JSON line.
    #[serde(skip)]
    pub series: Vec<(f64, usize, f64)>,
}

impl ContiguityOutcome {
    /// The figures of `r`, measured with the allocator named `allocator`.
    pub fn new(allocator: &str, r: &ContiguityReport) -> Self {
        ContiguityOutcome {
            allocator: allocator.into(),
            measured_requests: r.requests,
            pages_per_request: r.pages_per_request(),
            runs_per_request: r.runs_per_request(),
            mean_run_pages: r.mean_run_len(),
            transfer_blocks_per_request: r.transfer_blocks_per_request(),
            page_table_pages: r.page_table_pages,
            page_table_runs: r.page_table_runs,
            free_runs_mean: r.mean_sample(|f| f.free_runs as f64),
            largest_free_run_mean: r.mean_sample(|f| f.largest_run as f64),
            long_run_fraction_mean: {
                let with_free = r.samples.iter().filter(|s| s.fragmentation.free_pages > 0);
                let (n, sum) = with_free.fold((0usize, 0.0), |(n, sum), s| {
                    (n + 1, sum + s.fragmentation.long_run_fraction())
                });
                (n > 0).then(|| sum / n as f64)
            },
            samples: r.samples.len(),
            series: r
                .samples
                .iter()
                .filter(|s| s.fragmentation.free_pages > 0)
                .map(|s| {
                    let f = &s.fragmentation;
                    (s.time_s, f.free_runs, f.long_run_fraction())
                })
                .collect(),
        }
    }
}

impl fmt::Display for ContiguityOutcome {
    /// One line: the per-request figures, the page-table reads and the fragmentation.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "allocator {}: {:.1} pages/req in {:.2} runs (mean run {:.1} pages) | PD transfer \
             {:.2} blocks/req per region | page-table reads {} by page, {} by run | free runs \
             {:.1}, largest {:.1} pages, {} in runs >= {LONG_RUN_TOKENS} tokens",
            self.allocator,
            self.pages_per_request,
            self.runs_per_request,
            self.mean_run_pages,
            self.transfer_blocks_per_request,
            self.page_table_pages,
            self.page_table_runs,
            self.free_runs_mean,
            self.largest_free_run_mean,
            percent(self.long_run_fraction_mean)
        )
    }
}

/// A share as a percentage, `-` for none.
fn percent(share: Option<f64>) -> String {
    share.map_or("-".into(), |f| format!("{:.1}%", 100.0 * f))
}

/// A configuration's label and figures, as the table shows them.
pub struct ContiguityRow<'a> {
    /// What else tells the configuration apart (schedule / eviction / capacity).
    pub label: String,
    /// Its figures.
    pub outcome: &'a ContiguityOutcome,
}

/// The contiguity table: one row per configuration.
pub fn render_contiguity_table(rows: &[ContiguityRow<'_>]) -> String {
    let mut cells = vec![[
        "allocator",
        "config",
        "pages/req",
        "runs/req",
        "run_len",
        "xfer_blocks/req",
        "pt_reads_pages",
        "pt_reads_runs",
        "pt_saving",
        "free_runs",
        "largest_free",
        "long_runs",
    ]
    .map(String::from)
    .to_vec()];
    for r in rows {
        let o = r.outcome;
        let saving = if o.page_table_runs == 0 {
            "-".to_string()
        } else {
            format!(
                "{:.1}x",
                o.page_table_pages as f64 / o.page_table_runs as f64
            )
        };
        cells.push(vec![
            o.allocator.clone(),
            r.label.clone(),
            format!("{:.1}", o.pages_per_request),
            format!("{:.2}", o.runs_per_request),
            format!("{:.1}", o.mean_run_pages),
            format!("{:.2}", o.transfer_blocks_per_request),
            o.page_table_pages.to_string(),
            o.page_table_runs.to_string(),
            saving,
            format!("{:.1}", o.free_runs_mean),
            format!("{:.1}", o.largest_free_run_mean),
            percent(o.long_run_fraction_mean),
        ]);
    }
    crate::report::align_rows(&cells, &[0, 1])
}

/// Plots the share of free pages in long runs over simulated time, one line per
/// configuration.
pub fn plot_fragmentation(
    rows: &[ContiguityRow<'_>],
    subtitle: &str,
    page_size: u32,
    path: &std::path::Path,
) -> Result<()> {
    let series = rows
        .iter()
        .map(|r| {
            let points = r
                .outcome
                .series
                .iter()
                .map(|&(t, _, f)| (t, 100.0 * f))
                .collect();
            (format!("{} ({})", r.outcome.allocator, r.label), points)
        })
        .collect();
    crate::plot::plot_lines(
        &crate::plot::LinePlot {
            title: format!(
                "Free pages in runs of >= {LONG_RUN_TOKENS} tokens (page size {page_size})"
            ),
            subtitle: subtitle.into(),
            x_desc: "simulated time (s)".into(),
            y_desc: "share of free pages".into(),
            y_percent: true,
            x_log: false,
            series,
        },
        path,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_lists_parse() {
        assert_eq!(parse_allocators("all").unwrap(), AllocatorChoice::ALL);
        assert_eq!(
            parse_allocators("paged, best_fit").unwrap(),
            [AllocatorChoice::Paged, AllocatorChoice::BestFit]
        );
        let e = parse_allocators("paged,buddy").unwrap_err().to_string();
        assert!(e.contains("--allocator") && e.contains("buddy"), "{e}");
        let (a, sort) = AllocatorChoice::Sorted.build(64, 4).unwrap();
        assert_eq!((a.name(), sort), ("paged", true));
        assert!(AllocatorChoice::Token.build(63, 4).is_err());
    }

    #[test]
    fn transfer_blocks_are_runs_on_both_sides() {
        let pages = [3, 4, 5, 9, 10, 2].map(Page);
        assert_eq!(transfer_blocks(&pages), 3);
        assert_eq!(transfer_blocks(&[]), 0);
    }
}
