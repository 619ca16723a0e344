//! `kvserve info`: what this build has (features, backends and the device each opens,
//! allocators, prefix caches, policies, KV dtypes, architectures, the cuda backend's decode
//! graphs and opt-in tensor-core forms under the given flags).

use std::io::Write;

use crate::cli::InfoArgs;
use crate::error::{EngineError, Result};
use crate::setup::{CudaGraphSetup, Inventory};

/// `kvserve info`.
pub fn info(args: &InfoArgs, out: &mut dyn Write) -> Result<()> {
    let graphs = CudaGraphSetup::new(
        args.disable_cuda_graph,
        args.cuda_graph_max_bs,
        args.max_running_requests,
    )?;
    let inventory = Inventory::of_this_build()
        .probe(args.enable_deterministic_inference)
        .with_cuda_graphs(&graphs, args.max_running_requests)
        .with_cuda_tensor_cores(args.tensor_cores.forms());
    let text = if args.json {
        serde_json::to_string_pretty(&inventory)
            .map_err(|e| EngineError::arg("--json", e.to_string()))?
    } else {
        inventory.to_string()
    };
    writeln!(out, "{text}").map_err(|source| EngineError::Io {
        path: "standard output".into(),
        source,
    })
}
