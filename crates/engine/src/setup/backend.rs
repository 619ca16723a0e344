//! `--backend`: which compute backend the model runs on, and whether this build has it.

use std::fmt;

use serde::Serialize;

use crate::error::{EngineError, NotCompiled, Result};

/// A compute backend the engine can run the model on (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// The CPU backend of `crates/attention` (always compiled).
    Cpu,
    /// `crates/attention-wgpu`: Vulkan, Metal, DX12 or GL through wgpu (feature `wgpu`).
    Wgpu,
    /// `crates/attention-cuda` on an NVIDIA GPU through cudarc (feature `cuda`, or `cuda-13`).
    Cuda,
    /// `crates/attention-cuda` on an AMD GPU through HIP and hipRTC (feature `rocm`).
    Rocm,
}

impl BackendKind {
    /// Every backend kind, compiled or not, in `--backend` order.
    pub const ALL: [BackendKind; 4] = [
        BackendKind::Cpu,
        BackendKind::Wgpu,
        BackendKind::Cuda,
        BackendKind::Rocm,
    ];

    /// The `--backend` value.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Rocm => "rocm",
        }
    }

    /// The engine's Cargo feature that compiles it (`None`: always there).
    pub fn feature(self) -> Option<&'static str> {
        match self {
            BackendKind::Cpu => None,
            BackendKind::Wgpu => Some("wgpu"),
            BackendKind::Cuda => Some("cuda"),
            BackendKind::Rocm => Some("rocm"),
        }
    }

    /// Whether this build has it. The runner stand-ins of `setup/components.rs` are compiled
    /// under the same conditions.
    pub fn compiled(self) -> bool {
        match self {
            BackendKind::Cpu => true,
            BackendKind::Wgpu => cfg!(feature = "wgpu"),
            BackendKind::Cuda => cfg!(any(feature = "cuda", feature = "cuda-13")),
            BackendKind::Rocm => cfg!(feature = "rocm"),
        }
    }

    /// The error of choosing this backend in a build without it.
    pub fn not_compiled(self) -> NotCompiled {
        NotCompiled {
            what: "backend",
            name: self.name(),
            feature: self.feature(),
        }
    }

    /// The compiled backends' names, for error messages.
    pub fn compiled_names() -> Vec<&'static str> {
        Self::ALL
            .iter()
            .filter(|b| b.compiled())
            .map(|b| b.name())
            .collect()
    }

    /// Parses a `--backend` value. An unknown name and a backend this build lacks are both
    /// errors naming the flag and the compiled choices.
    pub fn parse(name: &str) -> Result<Self> {
        let compiled = Self::compiled_names().join(", ");
        let kind = Self::ALL
            .into_iter()
            .find(|b| b.name().eq_ignore_ascii_case(name.trim()))
            .ok_or_else(|| {
                EngineError::arg(
                    "--backend",
                    format!("unknown backend {name:?}; compiled backends: {compiled}"),
                )
            })?;
        if !kind.compiled() {
            return Err(EngineError::arg(
                "--backend",
                kind.not_compiled().to_string() + &format!("; compiled backends: {compiled}"),
            ));
        }
        Ok(kind)
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
