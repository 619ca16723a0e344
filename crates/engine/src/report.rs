//! Reports of replays: an aligned text table for people, JSON lines for programs.

use std::fmt::Write as _;

use crate::cache_sim::ReplayResult;
use crate::workload::WorkloadStats;

/// What a table shows besides the results.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TableOptions<'a> {
    /// Header lines about the workload (its name and sizes).
    pub workload: Option<(&'a str, &'a WorkloadStats)>,
    /// Whether to show the timing columns (`seconds`, `Mtok/s`); without them the table is a
    /// deterministic function of the inputs.
    pub timings: bool,
}

/// Renders `results` as an aligned table, one row per replay.
pub fn render_table(results: &[ReplayResult], opts: TableOptions<'_>) -> String {
    let mut out = String::new();
    if let Some((name, s)) = opts.workload {
        let _ = writeln!(out, "workload: {name}");
        let _ = writeln!(
            out,
            "requests {}, prompt tokens {}, longest prompt {}; at page size {}: unique tokens {}, \
             infinite-capacity hit rate {:.2}%",
            s.requests,
            s.prompt_tokens,
            s.max_prompt_tokens,
            s.page_size,
            s.unique_tokens,
            100.0 * s.ideal_hit_rate()
        );
    }
    let mut header = vec![
        "policy",
        "capacity_tokens",
        "page",
        "hit_rate",
        "cached_tokens",
        "evicted_tokens",
        "skipped",
    ];
    // With a host tier, the hit rate per tier (the columns appear only then).
    let tiered = results.iter().any(|r| r.tiers.is_some());
    if tiered {
        header.extend(["host_tokens", "device_hit", "host_hit", "storage_hit"]);
    }
    // With both `lru` and `belady` in the sweep: the share of the gap between them closed.
    let gaps = results.iter().any(|r| r.gap_closed.is_some());
    if gaps {
        header.push("gap_closed");
    }
    if opts.timings {
        header.extend(["seconds", "Mtok/s"]);
    }
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            let mut row = vec![
                r.policy.clone(),
                r.capacity_tokens.to_string(),
                r.page_size.to_string(),
                format!("{:.2}%", 100.0 * r.hit_rate),
                r.cached_tokens.to_string(),
                r.evicted_tokens.to_string(),
                r.skipped_requests.to_string(),
            ];
            if tiered {
                match &r.tiers {
                    Some(t) => row.extend([
                        t.host_capacity_tokens.to_string(),
                        format!("{:.2}%", 100.0 * t.device_hit_rate),
                        format!("{:.2}%", 100.0 * t.host_hit_rate),
                        format!("{:.2}%", 100.0 * t.storage_hit_rate),
                    ]),
                    None => row.extend(["-"; 4].map(String::from)),
                }
            }
            if gaps {
                row.push(
                    r.gap_closed
                        .map_or("-".into(), |g| format!("{:.1}%", 100.0 * g)),
                );
            }
            if opts.timings {
                row.push(format!("{:.3}", r.seconds));
                row.push(format!("{:.1}", r.tokens_per_s / 1e6));
            }
            row
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].len())
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[&str], out: &mut String| {
        let mut s = String::new();
        for (c, cell) in cells.iter().enumerate() {
            if c == 0 {
                let _ = write!(s, "{cell:<w$}", w = widths[c]);
            } else {
                let _ = write!(s, "  {cell:>w$}", w = widths[c]);
            }
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(&header, &mut out);
    for row in &rows {
        line(
            &row.iter().map(String::as_str).collect::<Vec<_>>(),
            &mut out,
        );
    }
    out
}

/// Rows of cells as an aligned table, columns two spaces apart: the columns in `left` flush
/// left (names), the others right (figures); trailing spaces trimmed. Rows may be shorter than
/// others (their missing cells are empty).
pub fn align_rows(rows: &[Vec<String>], left: &[usize]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(String::len)
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, v)| {
                if left.contains(&c) {
                    format!("{v:<w$}", w = widths[c])
                } else {
                    format!("{v:>w$}", w = widths[c])
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// Renders `results` as JSON lines: one object per replay.
pub fn render_json_lines(results: &[ReplayResult]) -> String {
    let mut out = String::new();
    for r in results {
        // A plain struct of strings and numbers always serializes.
        out.push_str(&serde_json::to_string(r).unwrap_or_default());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(policy: &str, hit_rate: f64) -> ReplayResult {
        ReplayResult {
            policy: policy.into(),
            capacity_tokens: 1024,
            page_size: 16,
            requests: 10,
            skipped_requests: 0,
            prompt_tokens: 1000,
            cached_tokens: (hit_rate * 1000.0) as u64,
            hit_rate,
            evicted_tokens: 32,
            seconds: 0.5,
            tokens_per_s: 2000.0,
            tiers: None,
            gap_closed: None,
        }
    }

    #[test]
    fn json_lines_have_the_documented_fields() {
        let text = render_json_lines(&[result("lru", 0.25), result("mru", 0.5)]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        let v: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
        for field in [
            "policy",
            "capacity_tokens",
            "page_size",
            "requests",
            "prompt_tokens",
            "cached_tokens",
            "hit_rate",
            "evicted_tokens",
            "seconds",
            "skipped_requests",
            "tokens_per_s",
        ] {
            assert!(v.get(field).is_some(), "missing {field}");
        }
        assert_eq!(v["policy"], "mru");
        assert_eq!(v["hit_rate"], 0.5);
    }

    #[test]
    fn gap_closed_is_measured_between_lru_and_belady_at_each_capacity() {
        let mut rs = vec![
            result("lru", 0.2),
            result("lineage-ttl", 0.3),
            result("mru", 0.1),
            result("belady", 0.6),
            // Another capacity without a Belady run: no gap there.
            ReplayResult {
                capacity_tokens: 2048,
                ..result("lru", 0.5)
            },
        ];
        crate::cache_sim::fill_gap_closed(&mut rs);
        let gaps: Vec<Option<f64>> = rs.iter().map(|r| r.gap_closed).collect();
        let want: [Option<f64>; 5] = [Some(0.0), Some(0.25), Some(-0.25), Some(1.0), None];
        for (g, w) in gaps.iter().zip(want) {
            assert_eq!(g.map(|x| (x * 1e9).round()), w.map(|x| (x * 1e9).round()));
        }
        let t = render_table(&rs, TableOptions::default());
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].ends_with("gap_closed"), "{t}");
        assert!(
            lines[2].ends_with("25.0%") && lines[3].ends_with("-25.0%"),
            "{t}"
        );
        assert!(lines[5].ends_with('-'), "{t}");
        // Belady not ahead of LRU: nothing to close.
        let mut tie = vec![result("lru", 0.4), result("belady", 0.4)];
        crate::cache_sim::fill_gap_closed(&mut tie);
        assert!(tie.iter().all(|r| r.gap_closed.is_none()));
        let json = render_json_lines(&tie);
        assert!(!json.contains("gap_closed"), "absent, not null: {json}");
    }

    #[test]
    fn table_columns_align() {
        let t = render_table(
            &[result("lru", 0.25), result("cost-aware", 0.5)],
            TableOptions {
                workload: None,
                timings: true,
            },
        );
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("policy    "));
        assert!(lines[2].contains("50.00%") && lines[2].ends_with("0.500     0.0"));
        assert_eq!(lines[1].len(), lines[2].len());
    }
}
