//! Where the model comes from: the built-in tiny preset or a Hugging Face directory.

use crate::error::{EngineError, Result};

/// Where the model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// The built-in `tiny` preset (seeded random weights, `r50k_base` vocabulary).
    Tiny,
    /// A Hugging Face model directory.
    Path(std::path::PathBuf),
}

impl ModelSource {
    /// The model's configuration (`config.json` of a directory), without loading weights.
    pub fn config(&self) -> Result<model::ModelConfig> {
        match self {
            ModelSource::Tiny => Ok(model::tiny::tiny_config()),
            ModelSource::Path(dir) => model::ModelConfig::from_file(&dir.join("config.json"))
                .map_err(|e| EngineError::Model(e.to_string())),
        }
    }

    /// The name the server reports (`tiny`, or the directory).
    pub fn name(&self) -> String {
        match self {
            ModelSource::Tiny => "tiny".into(),
            ModelSource::Path(dir) => dir.display().to_string(),
        }
    }
}
