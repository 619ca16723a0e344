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

    /// The tokenizer and the model's chat template (if it has one) the server encodes
    /// prompts with.
    pub fn tokenizer(&self) -> Result<(model::Tokenizer, Option<model::ChatTemplate>)> {
        match self {
            ModelSource::Tiny => Ok((model::tiny::tiny_tokenizer(), None)),
            ModelSource::Path(dir) => {
                model::load_tokenizer_dir(dir).map_err(|e| EngineError::Model(e.to_string()))
            }
        }
    }

    /// The source a `--tokenizer-path` names: a directory, or `tiny` (the built-in preset)
    /// when no directory of that name exists.
    pub fn from_tokenizer_arg(path: &std::path::Path) -> Self {
        if path == std::path::Path::new("tiny") && !path.is_dir() {
            ModelSource::Tiny
        } else {
            ModelSource::Path(path.to_path_buf())
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
