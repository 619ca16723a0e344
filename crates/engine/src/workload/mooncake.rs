//! Mooncake JSONL traces (FAST'25, kvcache-ai/Mooncake): one JSON object per line with
//! `timestamp` (arrival, milliseconds), `input_length`, `output_length` and `hash_ids` (one id per
//! 512-token block of the prompt; the last id covers the final, possibly partial, block).
//!
//! Token synthesis: block ids are numbered densely in order of first appearance (`d`), and token
//! `j` of a block is `d × 512 + j`. Equal ids give equal tokens, different ids give disjoint
//! tokens (no two blocks share any token id), and a prompt is exactly `input_length` tokens: the
//! first `input_length` tokens of its blocks. So two prompts share a prefix of `k` whole blocks
//! iff their first `k` ids are equal, at any page size that divides 512; at page size 512 only
//! whole blocks can be shared. The ids are synthetic: they are not valid for a model's
//! vocabulary.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use serde::Deserialize;

use crate::error::{EngineError, Result};
use crate::workload::{Request, Workload};

/// Tokens per hash id in Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// Distinct blocks whose synthesized tokens fit in `u32`.
const MAX_BLOCKS: usize = (u32::MAX as usize + 1) / MOONCAKE_BLOCK_TOKENS;

#[derive(Debug, Deserialize)]
struct Line {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// Loads a Mooncake JSONL trace from `path` (errors name the path; the workload is named after
/// the file).
pub fn load_mooncake(path: &Path) -> Result<Workload> {
    let name = path.display().to_string();
    let file = File::open(path).map_err(|source| EngineError::Io {
        path: name.clone(),
        source,
    })?;
    let mut workload = parse_mooncake(BufReader::new(file), &name)?;
    if let Some(file_name) = path.file_name() {
        workload.name = format!("mooncake trace {}", file_name.to_string_lossy());
    }
    Ok(workload)
}

/// Parses a Mooncake JSONL trace from `reader`; `source` names it in errors and in the
/// workload's name. Blank lines are skipped; any other malformed line is an error naming its
/// (1-based) number.
pub fn parse_mooncake(reader: impl BufRead, source: &str) -> Result<Workload> {
    let mut dense: HashMap<u64, u32> = HashMap::new();
    let mut requests = Vec::new();
    for (index, line) in reader.lines().enumerate() {
        let number = index + 1;
        let bad = |message: String| EngineError::TraceLine {
            path: source.to_string(),
            line: number,
            message,
        };
        let line = line.map_err(|e| bad(format!("cannot read: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let entry: Line = serde_json::from_str(&line).map_err(|e| bad(json_message(&e)))?;
        let blocks = (entry.input_length as usize).div_ceil(MOONCAKE_BLOCK_TOKENS);
        if entry.hash_ids.len() != blocks {
            return Err(bad(format!(
                "input_length {} needs {blocks} hash_ids (one per {MOONCAKE_BLOCK_TOKENS} tokens), \
                 found {}",
                entry.input_length,
                entry.hash_ids.len()
            )));
        }
        if !entry.timestamp.is_finite() || entry.timestamp < 0.0 {
            return Err(bad(format!(
                "timestamp {} is not a non-negative number of milliseconds",
                entry.timestamp
            )));
        }
        let len = entry.input_length as usize;
        let mut tokens = Vec::with_capacity(len);
        for &id in &entry.hash_ids {
            let next = dense.len();
            let d = *dense.entry(id).or_insert(next as u32);
            if dense.len() > MAX_BLOCKS {
                return Err(bad(format!(
                    "more than {MAX_BLOCKS} distinct hash_ids: synthesized tokens would not fit in 32 bits"
                )));
            }
            let base = d * MOONCAKE_BLOCK_TOKENS as u32;
            let take = (len - tokens.len()).min(MOONCAKE_BLOCK_TOKENS) as u32;
            tokens.extend(base..base + take);
        }
        requests.push(Request {
            tokens,
            output_len: entry.output_length as usize,
            arrival_s: entry.timestamp / 1000.0,
        });
    }
    if requests.is_empty() {
        return Err(EngineError::EmptyWorkload {
            what: format!("{source} has no trace lines"),
        });
    }
    Ok(Workload {
        name: format!("mooncake trace {source}"),
        requests,
    })
}

/// serde_json's message without its "at line 1 column N" suffix (we parse one line at a time,
/// so the line is ours to report), with the column kept.
fn json_message(e: &serde_json::Error) -> String {
    let full = e.to_string();
    let msg = full
        .rfind(" at line ")
        .map_or(full.as_str(), |i| &full[..i]);
    format!("invalid trace entry: {msg} (column {})", e.column())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthesizes_tokens_from_block_ids() {
        let text = r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]}

{"timestamp": 1500, "input_length": 10, "output_length": 1, "hash_ids": [8], "extra": true}
"#;
        let w = parse_mooncake(text.as_bytes(), "t.jsonl").unwrap();
        assert_eq!(w.requests.len(), 2);
        let (a, b) = (&w.requests[0], &w.requests[1]);
        assert_eq!(a.tokens.len(), 600);
        assert_eq!(a.tokens[0], 0);
        assert_eq!(a.tokens[511], 511);
        assert_eq!(a.tokens[512], 512);
        assert_eq!(a.tokens[599], 599);
        // Block 8 is dense id 1 in both requests.
        assert_eq!(b.tokens, (512..522).collect::<Vec<u32>>());
        assert_eq!((a.output_len, b.output_len), (5, 1));
        assert_eq!(b.arrival_s, 1.5);
    }

    #[test]
    fn malformed_lines_are_named() {
        let cases = [
            ("{\"timestamp\": 0}", "missing field"),
            ("not json", "invalid trace entry"),
            (
                r#"{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}"#,
                "needs 2 hash_ids",
            ),
            (
                r#"{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}"#,
                "timestamp",
            ),
            (
                r#"{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}"#,
                "invalid value",
            ),
        ];
        for (bad, expect) in cases {
            let text = format!(
                "{}\n{bad}\n",
                r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}"#
            );
            let err = parse_mooncake(text.as_bytes(), "x.jsonl")
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("x.jsonl line 2: "), "{err}");
            assert!(err.contains(expect), "{err}");
            assert!(!err.contains("at line 1"), "{err}");
        }
        let err = parse_mooncake("\n\n".as_bytes(), "e.jsonl").unwrap_err();
        assert!(err.to_string().contains("no trace lines"), "{err}");
    }
}
