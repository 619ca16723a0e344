//! The crate's error type. Bad input (an unreadable file, a malformed trace line, a bad flag) is
//! an error naming the file and line or the flag, never a panic; the `kvserve` binary prints it
//! and exits with code 2.

use kv_pool::KvPoolError;
use radix_cache::RadixCacheError;

/// Errors of the engine: workloads, replays, reports and plots.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A file that could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: String,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// A malformed line of a trace file (1-based line number).
    #[error("{path} line {line}: {message}")]
    TraceLine {
        /// The trace file.
        path: String,
        /// The line number, counting from 1.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// A bad command-line flag or configuration value, named as the command line spells it.
    #[error("{flag}: {message}")]
    InvalidArgument {
        /// The flag (e.g. `--capacity-tokens`).
        flag: &'static str,
        /// What is wrong with its value.
        message: String,
    },
    /// A workload with no requests.
    #[error("the workload has no requests ({what})")]
    EmptyWorkload { what: String },
    /// The replay's accounting or ownership check failed: a bug in the cache or the replay.
    #[error("check failed after {after}: {message}")]
    CheckFailed {
        /// Where in the replay (e.g. "request 17").
        after: String,
        /// What did not hold.
        message: String,
    },
    /// Drawing a plot failed.
    #[error("plot {path}: {message}")]
    Plot {
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A model could not be built or loaded (bad checkpoint, unsupported architecture).
    #[error("model: {0}")]
    Model(String),
    /// The scheduler or the simulator failed (a bug, or a stalled simulation).
    #[error("simulation: {0}")]
    Simulation(String),
    /// A prefix-cache operation failed (a bug, or an unknown policy name).
    #[error(transparent)]
    Cache(#[from] RadixCacheError),
    /// An allocator operation failed.
    #[error(transparent)]
    Pool(#[from] KvPoolError),
    /// A component (a backend) that this build does not have.
    #[error(transparent)]
    NotCompiled(#[from] NotCompiled),
}

/// A component that this build does not have: which one and the feature that would bring it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} {name:?} is not compiled into this build ({})", match feature {
    Some(f) => format!("rebuild with `--features {f}`"),
    None => "no feature of this version provides it yet".to_string(),
})]
pub struct NotCompiled {
    /// The component kind (e.g. "backend").
    pub what: &'static str,
    /// Its name (e.g. "wgpu").
    pub name: &'static str,
    /// The Cargo feature of the engine crate that compiles it (`None`: not written yet).
    pub feature: Option<&'static str>,
}

impl EngineError {
    /// A bad value of `flag`.
    pub fn arg(flag: &'static str, message: impl Into<String>) -> Self {
        EngineError::InvalidArgument {
            flag,
            message: message.into(),
        }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
