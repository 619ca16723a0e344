//! PNG plots of replays: hit rate against capacity, one line per policy. Text is drawn with
//! DejaVu Sans embedded in the binary (the `dejavu` crate, registered with plotters'
//! `ab_glyph` backend as "sans-serif"), so no system font is read.

use std::path::Path;
use std::sync::Once;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::prelude::*;

use crate::cache_sim::ReplayResult;
use crate::error::{EngineError, Result};

static REGISTER_FONT: Once = Once::new();

fn register_font() {
    REGISTER_FONT.call_once(|| {
        // The embedded TTF is valid; if registration ever failed, drawing text would return
        // an error (reported), not panic.
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

/// A line chart: one line per series, x = capacity in tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct LinePlot {
    pub title: String,
    /// Line under the caption (the workload).
    pub subtitle: String,
    pub x_desc: String,
    pub y_desc: String,
    /// Whether y values are percentages (axis from 0 to 100 at most, labels with `%`).
    pub y_percent: bool,
    /// Whether the x axis may be logarithmic (it is when the x values span more than a
    /// factor of 4); off for axes like percentiles.
    pub x_log: bool,
    /// Named series of (x, y) points.
    pub series: Vec<(String, Vec<(f64, f64)>)>,
}

/// Draws hit rate (%) against capacity (tokens, logarithmic when the capacities span more
/// than a factor of 4, ticks at the capacities replayed) for every policy in `results`, into
/// the PNG file `path` (1024 × 640 pixels). Policies with identical results share a line
/// labelled `a = b`. `title` (the workload) goes under the caption.
pub fn plot_hit_rates(results: &[ReplayResult], title: &str, path: &Path) -> Result<()> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut names: Vec<&str> = Vec::new();
    for r in results {
        if !names.contains(&r.policy.as_str()) {
            names.push(&r.policy);
        }
    }
    for name in names {
        let points = results
            .iter()
            .filter(|r| r.policy == name)
            .map(|r| (r.capacity_tokens as f64, 100.0 * r.hit_rate))
            .collect();
        series.push((name.to_string(), points));
        // With a host tier the total counts every tier; the device's own share beside it.
        let device: Vec<(f64, f64)> = results
            .iter()
            .filter(|r| r.policy == name)
            .filter_map(|r| {
                let t = r.tiers.as_ref()?;
                Some((r.capacity_tokens as f64, 100.0 * t.device_hit_rate))
            })
            .collect();
        if !device.is_empty() {
            series.push((format!("{name} (device only)"), device));
        }
    }
    let page = results.first().map_or(1, |r| r.page_size);
    plot_lines(
        &LinePlot {
            title: "KV cache hit rate vs capacity".into(),
            subtitle: title.into(),
            x_desc: format!("capacity (tokens, page size {page})"),
            y_desc: "hit rate (% of prompt tokens)".into(),
            y_percent: true,
            x_log: true,
            series,
        },
        path,
    )
}

/// Draws the share of the LRU → Belady gap closed (%, [`ReplayResult::gap_closed`]) against
/// capacity for every policy in `results` but the two ends (`lru` at 0 %, `belady` at 100 %)
/// into the PNG file `path`; capacities where the gap is undefined are left out. Returns
/// `Ok(false)` (writing nothing) when no result has a gap, i.e. the sweep lacked `lru` or
/// `belady`.
pub fn plot_gap_closed(results: &[ReplayResult], title: &str, path: &Path) -> Result<bool> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in results {
        let Some(g) = r.gap_closed else { continue };
        if r.policy == "lru" || r.policy == crate::cache_sim::BELADY {
            continue;
        }
        let point = (r.capacity_tokens as f64, 100.0 * g);
        match series.iter_mut().find(|(n, _)| *n == r.policy) {
            Some((_, points)) => points.push(point),
            None => series.push((r.policy.clone(), vec![point])),
        }
    }
    if series.is_empty() {
        return Ok(false);
    }
    let page = results.first().map_or(1, |r| r.page_size);
    plot_lines(
        &LinePlot {
            title: "Share of the LRU → Belady hit-rate gap closed".into(),
            subtitle: title.into(),
            x_desc: format!("capacity (tokens, page size {page})"),
            y_desc: "gap closed (%; 0 = LRU, 100 = Belady)".into(),
            y_percent: false,
            x_log: true,
            series,
        },
        path,
    )?;
    Ok(true)
}

/// Draws `plot` into the PNG file `path` (1024 × 640 pixels). Points are sorted by x; series
/// with identical points share one line labelled `a = b`; the x axis has ticks exactly at the
/// x values and is logarithmic when they span more than a factor of 4.
pub fn plot_lines(plot: &LinePlot, path: &Path) -> Result<()> {
    let name = path.display().to_string();
    let fail = |e: &dyn std::fmt::Display| EngineError::Plot {
        path: name.clone(),
        message: e.to_string(),
    };
    if plot.series.iter().all(|(_, p)| p.is_empty()) {
        return Err(fail(&"no results to plot"));
    }
    register_font();
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for (label, points) in &plot.series {
        let mut points = points.clone();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        match series.iter_mut().find(|(_, p)| *p == points) {
            Some((l, _)) => {
                l.push_str(" = ");
                l.push_str(label);
            }
            None => series.push((label.clone(), points)),
        }
    }
    let mut ticks: Vec<f64> = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.0))
        .collect();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    let axis = CapacityAxis::new(ticks, plot.x_log);
    let y_max = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold(0.0f64, f64::max);
    // Below 0 only when a value is (a policy behind LRU in a gap plot).
    let y_min = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold(0.0f64, f64::min);
    let y_bottom = if y_min < 0.0 { y_min * 1.15 } else { 0.0 };
    let y_top = if plot.y_percent {
        ((y_max / 10.0).ceil() * 10.0 + 5.0).clamp(10.0, 100.0)
    } else {
        (y_max * 1.15).max(1e-9)
    };

    let root = BitMapBackend::new(path, (1024, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let x_desc = format!(
        "{}{}",
        plot.x_desc,
        if axis.log { ", log scale" } else { "" }
    );
    let area = root
        .titled(&plot.title, ("sans-serif", 24))
        .and_then(|a| a.titled(&plot.subtitle, ("sans-serif", 15)))
        .map_err(|e| fail(&e))?;
    let mut chart = ChartBuilder::on(&area)
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(axis, y_bottom..y_top)
        .map_err(|e| fail(&e))?;
    let percent = plot.y_percent;
    chart
        .configure_mesh()
        .x_desc(x_desc.as_str())
        .y_desc(plot.y_desc.as_str())
        .x_label_formatter(&|x| human_tokens(*x))
        .y_label_formatter(&|y| {
            if percent {
                format!("{y:.0}%")
            } else {
                human_number(*y)
            }
        })
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .max_light_lines(1)
        .draw()
        .map_err(|e| fail(&e))?;
    for (k, (label, points)) in series.iter().enumerate() {
        let color = Palette99::pick(k).to_rgba();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)).point_size(4))
            .map_err(|e| fail(&e))?
            .label(label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

/// A y value with a thousands suffix (1.2k, 3.4M) or three significant digits.
fn human_number(y: f64) -> String {
    if y < 0.0 {
        return format!("-{}", human_number(-y));
    }
    if y >= 1e6 {
        format!("{:.1}M", y / 1e6)
    } else if y >= 1e3 {
        format!("{:.1}k", y / 1e3)
    } else if y >= 1.0 || y == 0.0 {
        format!("{y:.0}")
    } else {
        format!("{y:.3}")
    }
}

/// The capacity axis: ticks exactly at the capacities replayed, logarithmic when they span
/// more than a factor of 4, padded by a margin on both sides.
#[derive(Debug, Clone)]
struct CapacityAxis {
    ticks: Vec<f64>,
    log: bool,
    /// The mapped (log or linear) range.
    lo: f64,
    hi: f64,
}

impl CapacityAxis {
    fn new(ticks: Vec<f64>, allow_log: bool) -> Self {
        let (min, max) = (ticks[0].max(1.0), ticks[ticks.len() - 1].max(1.0));
        let log = allow_log && max > 4.0 * min;
        let (a, b) = if log {
            (min.ln(), max.ln())
        } else {
            (min, max)
        };
        let pad = if b > a {
            (b - a) * 0.06
        } else if log {
            0.5
        } else {
            a.max(1.0) * 0.1
        };
        CapacityAxis {
            ticks,
            log,
            lo: a - pad,
            hi: b + pad,
        }
    }

    fn scale(&self, v: f64) -> f64 {
        if self.log {
            v.max(1.0).ln()
        } else {
            v
        }
    }
}

impl Ranged for CapacityAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let t = (self.scale(*value) - self.lo) / (self.hi - self.lo);
        limit.0 + (t * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        let max = hint.max_num_points().max(1);
        let stride = self.ticks.len().div_ceil(max).max(1);
        self.ticks.iter().copied().step_by(stride).collect()
    }

    fn range(&self) -> std::ops::Range<f64> {
        let unscale = |v: f64| if self.log { v.exp() } else { v };
        unscale(self.lo)..unscale(self.hi)
    }
}

/// `1536` → `1.5K`, `5849088` → `5.8M`.
fn human_tokens(x: f64) -> String {
    let (v, unit) = if x >= 1e9 {
        (x / 1e9, "G")
    } else if x >= 1e6 {
        (x / 1e6, "M")
    } else if x >= 1e3 {
        (x / 1e3, "K")
    } else {
        (x, "")
    };
    if v >= 100.0 || v.fract().abs() < 0.05 {
        format!("{v:.0}{unit}")
    } else {
        format!("{v:.1}{unit}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_token_labels() {
        assert_eq!(human_tokens(512.0), "512");
        assert_eq!(human_tokens(1536.0), "1.5K");
        assert_eq!(human_tokens(5_849_088.0), "5.8M");
        assert_eq!(human_tokens(2e9), "2G");
    }
}
