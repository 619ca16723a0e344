//! Developer tasks for the kvserve workspace, run as `cargo xtask <task>`.
//!
//! - `ci`: what CI runs — `cargo fmt --check`, `cargo clippy` with warnings denied over every
//!   target, then the whole test suite. One build profile (debug) and one package selection
//!   (`--workspace`) throughout, so nothing is compiled twice. The clippy pass also turns on
//!   transfer's `nixl` feature, so the NIXL backend is type-checked (against `nixl-sys`'s stub
//!   API; its build script needs libclang, Debian's `libclang-dev`) without a second build; on a
//!   machine without libclang that feature is left out with a note, except under `CI=true`.
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
    let mut clippy = vec!["clippy", "--workspace", "--all-targets", "--locked"];
    if libclang_found() {
        clippy.extend(["--features", "transfer/nixl"]);
    } else if std::env::var("CI").as_deref() == Ok("true") {
        return Err(
            "libclang not found: the nixl backend cannot be type-checked \
                    (apt-get install libclang-dev, or set LIBCLANG_PATH)"
                .into(),
        );
    } else {
        eprintln!(
            "xtask: libclang not found, so clippy leaves out transfer's `nixl` feature \
             (apt-get install libclang-dev, or set LIBCLANG_PATH, to check it)"
        );
    }
    clippy.extend(["--", "-D", "warnings"]);
    cargo(&clippy)?;
    test()
}

/// Whether bindgen (run by `nixl-sys`'s build script) can find libclang: `LIBCLANG_PATH`, or
/// `libclang.so` / `libclang-N.so` where Debian, Fedora and LLVM's own packages put it.
fn libclang_found() -> bool {
    if std::env::var_os("LIBCLANG_PATH").is_some() {
        return true;
    }
    let mut dirs: Vec<std::path::PathBuf> = [
        "/usr/lib",
        "/usr/lib64",
        "/usr/local/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
    ]
    .iter()
    .map(Into::into)
    .collect();
    if let Ok(entries) = std::fs::read_dir("/usr/lib") {
        dirs.extend(
            entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("llvm"))
                .map(|e| e.path().join("lib")),
        );
    }
    dirs.iter().any(|dir| {
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.flatten().any(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                // The development package's link names (the runtime alone lacks bindgen's headers).
                name == "libclang.so" || (name.starts_with("libclang-") && name.ends_with(".so"))
            })
        })
    })
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
