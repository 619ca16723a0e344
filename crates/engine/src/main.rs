//! `kvserve`: the command-line entry point. Parses the flags, runs the subcommand, and maps any
//! error to a one-line message on stderr and exit code 2 (clap's own usage errors also exit 2).

use std::process::ExitCode;

use clap::Parser;
use engine::cli::{run, Cli};
use engine::config_file::expand_config;

fn main() -> ExitCode {
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
