//! Developer tasks for the kvserve workspace, run as `cargo xtask <task>`.
//!
//! - `ci`: what CI runs — `cargo fmt --check`, `cargo clippy` with warnings denied over every
//!   target, then the whole test suite. One build profile (debug) and one package selection
//!   (`--workspace`) throughout, so nothing is compiled twice.
//! - `test`: the test suite alone.
//! - `bench [ARGS…]`: criterion benches in release mode (extra arguments go to criterion).
//!
//! No dependencies: it only sequences cargo commands and stops at the first failure.

use std::process::{Command, ExitCode};

fn cargo(args: &[&str]) -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("$ cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .status()
        .map_err(|e| format!("could not run {cargo}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`cargo {}` failed ({status})", args.join(" ")))
    }
}

fn ci() -> Result<(), String> {
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--locked",
        "--",
        "-D",
        "warnings",
    ])?;
    test()
}

fn test() -> Result<(), String> {
    cargo(&["test", "--workspace", "--locked"])
}

fn bench(extra: &[String]) -> Result<(), String> {
    let mut args = vec!["bench", "--workspace", "--locked"];
    if !extra.is_empty() {
        args.push("--");
        args.extend(extra.iter().map(String::as_str));
    }
    cargo(&args)
}

const USAGE: &str = "usage: cargo xtask <ci|test|bench [criterion args…]>";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("test") => test(),
        Some("bench") => bench(&args[1..]),
        Some("-h" | "--help") => {
            println!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown task {other:?}\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
