//! `kvserve`: the command-line entry point. Parses the flags, runs the subcommand, and maps any
//! error to a one-line message on stderr and exit code 2 (clap's own usage errors also exit 2).
//!
//! Before anything else it makes sure `XDG_RUNTIME_DIR` names a directory (see
//! [`ensure_runtime_dir`]), so that probing wgpu prints nothing kvserve did not say itself.

use std::process::ExitCode;

use clap::Parser;
use engine::cli::Cli;
use engine::commands::run;
use engine::config_file::expand_config;

fn main() -> ExitCode {
    ensure_runtime_dir();
    // `--config FILE.toml` becomes flags before clap sees the command line.
    let given: Vec<_> = std::env::args_os().collect();
    let args = match expand_config(given.clone()) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let from_file = args.len() != given.len();
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            if from_file && e.use_stderr() {
                eprintln!("note: the command line includes the flags of its --config file");
            }
            e.exit()
        }
    };
    let mut stdout = std::io::stdout().lock();
    match run(cli, &mut stdout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Points `XDG_RUNTIME_DIR` at a private directory when it is unset or not a directory.
///
/// Every command that probes wgpu (`info`, `serve`, `bench`) loads the system's Vulkan and GL
/// drivers. Mesa's Vulkan device-select layer (installed with its Vulkan drivers, lavapipe
/// included) calls libwayland's `wl_display_connect` while it picks the default device, and
/// libwayland prints `error: XDG_RUNTIME_DIR is invalid or not set in the environment.` to
/// stderr when the variable is unset or not an absolute path — as under `sudo`, `su`, cron,
/// containers and CI. kvserve opens no window, so the message is noise that reads as a kvserve
/// error. With the variable naming a directory that holds no Wayland socket, the connection
/// fails quietly. The directory is `std::env::temp_dir()/kvserve-runtime-<uid>`, created with
/// mode 0700 (the XDG spec's requirement), and used only if it is a real directory (not a
/// symlink) owned by this user and closed to others; otherwise the environment is left as it
/// was.
///
/// It runs first in `main`, before any thread exists, because changing the environment races
/// with threads that read it.
#[cfg(unix)]
fn ensure_runtime_dir() {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};

    let usable = |p: &std::path::Path| p.is_absolute() && p.is_dir();
    if std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|v| usable(std::path::Path::new(&v))) {
        return;
    }
    // This process's uid, without a libc dependency: the owner of its /proc entry.
    let Ok(uid) = std::fs::metadata("/proc/self").map(|m| m.uid()) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvserve-runtime-{uid}"));
    let _ = std::fs::DirBuilder::new().mode(0o700).create(&dir);
    let private = std::fs::symlink_metadata(&dir)
        .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.mode() & 0o077 == 0);
    if private {
        std::env::set_var("XDG_RUNTIME_DIR", &dir);
    }
}

#[cfg(not(unix))]
fn ensure_runtime_dir() {}
