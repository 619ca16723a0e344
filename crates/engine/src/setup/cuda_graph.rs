//! SGLang's `--disable-cuda-graph` and `--cuda-graph-max-bs`: whether the cuda backend
//! captures its decode forward as CUDA graphs (`attention_cuda::CudaGraphRunner`, installed
//! in the model runner at start-up) and up to which batch size.
//!
//! The flags are accepted with every backend, as SGLang accepts them on every platform, and
//! ignored where there are no graphs: cpu and wgpu, and rocm (HIP graphs are not written: the
//! HIP device launches on the null stream, which cannot be captured). Their values are checked
//! on every backend (a bad value is a bad value).

use std::fmt;

use serde::Serialize;

use super::backend::BackendKind;
use crate::error::{EngineError, Result};

/// The CUDA graph flags, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct CudaGraphSetup {
    /// `--disable-cuda-graph`.
    pub disable_cuda_graph: bool,
    /// `--cuda-graph-max-bs` (`None`: SGLang's list, up to 160 and `--max-running-requests`).
    pub cuda_graph_max_bs: Option<usize>,
}

/// Why decode batches run eagerly on a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphsOff {
    /// `--disable-cuda-graph`.
    Disabled,
    /// The backend has no graphs (the flags are ignored there).
    NoGraphs(BackendKind),
}

impl fmt::Display for GraphsOff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GraphsOff::Disabled => write!(f, "off (--disable-cuda-graph)"),
            GraphsOff::NoGraphs(BackendKind::Rocm) => write!(
                f,
                "off: HIP graphs are not written (the rocm backend launches on the null \
                 stream); decode runs eagerly"
            ),
            GraphsOff::NoGraphs(b) => {
                write!(f, "off: the {b} backend has no graphs; decode runs eagerly")
            }
        }
    }
}

impl CudaGraphSetup {
    /// The setup of the flags, for a scheduler of `max_running_requests`: a
    /// `--cuda-graph-max-bs` of 0, or above `--max-running-requests` (no batch is that large),
    /// is refused.
    pub fn new(
        disable_cuda_graph: bool,
        cuda_graph_max_bs: Option<usize>,
        max_running_requests: usize,
    ) -> Result<Self> {
        match cuda_graph_max_bs {
            Some(0) => Err(EngineError::arg(
                "--cuda-graph-max-bs",
                "0: must be at least 1 (--disable-cuda-graph turns graphs off)",
            )),
            Some(n) if n > max_running_requests => Err(EngineError::arg(
                "--cuda-graph-max-bs",
                format!(
                    "{n} exceeds --max-running-requests ({max_running_requests}): no decode \
                     batch is that large"
                ),
            )),
            _ => Ok(CudaGraphSetup {
                disable_cuda_graph,
                cuda_graph_max_bs,
            }),
        }
    }

    /// Whether `backend` captures its decode forward with this setup, or why not.
    pub fn graphs_on(&self, backend: BackendKind) -> std::result::Result<(), GraphsOff> {
        match backend {
            BackendKind::Cuda if self.disable_cuda_graph => Err(GraphsOff::Disabled),
            BackendKind::Cuda => Ok(()),
            b => Err(GraphsOff::NoGraphs(b)),
        }
    }

    /// `kvserve info`'s line: the batch sizes the cuda backend captures with this setup and
    /// `max_running_requests`, or why it captures none.
    pub fn describe(&self, max_running_requests: usize) -> String {
        if let Err(off) = self.graphs_on(BackendKind::Cuda) {
            return off.to_string();
        }
        match capture_bs(self.cuda_graph_max_bs, max_running_requests) {
            Some(bs) => format!("decode batches padded to bs {bs:?}; larger ones run eagerly"),
            None => format!(
                "off: the cuda backend is not compiled (feature `{}`)",
                BackendKind::Cuda.feature().unwrap_or("cuda")
            ),
        }
    }
}

/// The sizes the cuda backend captures (`None` in a build without it).
#[cfg(any(feature = "cuda", feature = "cuda-13"))]
fn capture_bs(max_bs: Option<usize>, max_running_requests: usize) -> Option<Vec<usize>> {
    Some(attention_cuda::capture_bs(max_bs, max_running_requests))
}

#[cfg(not(any(feature = "cuda", feature = "cuda-13")))]
fn capture_bs(_max_bs: Option<usize>, _max_running_requests: usize) -> Option<Vec<usize>> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_are_typed_errors_naming_the_flag() {
        let errors: Vec<String> = [(Some(0), 256), (Some(257), 256), (Some(9), 8)]
            .into_iter()
            .map(|(bs, max)| CudaGraphSetup::new(false, bs, max).unwrap_err().to_string())
            .collect();
        insta::assert_snapshot!(errors.join("\n"));
        assert!(CudaGraphSetup::new(false, Some(256), 256).is_ok());
        assert!(CudaGraphSetup::new(true, None, 1).is_ok());
    }

    /// Per backend and flags, whether decode batches go through graphs or why not.
    #[test]
    fn only_the_cuda_backend_captures_unless_disabled() {
        let mut table = String::new();
        for disable in [false, true] {
            let setup = CudaGraphSetup::new(disable, Some(8), 256).unwrap();
            for b in BackendKind::ALL {
                let on = match setup.graphs_on(b) {
                    Ok(()) => "graphs".to_string(),
                    Err(off) => off.to_string(),
                };
                table += &format!("disable={disable:<5} {:<4}: {on}\n", b.name());
            }
        }
        insta::assert_snapshot!(table);
    }
}
