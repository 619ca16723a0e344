//! `kvserve info`: what this build has (features, backends and the device each opens,
//! allocators, prefix caches, policies, KV dtypes, architectures).

use std::io::Write;

use crate::cli::InfoArgs;
use crate::error::{EngineError, Result};
use crate::setup::Inventory;

/// `kvserve info`.
pub fn info(args: &InfoArgs, out: &mut dyn Write) -> Result<()> {
    let inventory = Inventory::of_this_build().probe(args.enable_deterministic_inference);
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
