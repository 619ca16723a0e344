//! `kvserve`: the command-line entry point. Parses the flags, runs the subcommand, and maps any
//! error to a one-line message on stderr and exit code 2 (clap's own usage errors also exit 2).

use std::process::ExitCode;

use clap::Parser;
use engine::cli::{run, Cli};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut stdout = std::io::stdout().lock();
    match run(cli, &mut stdout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
