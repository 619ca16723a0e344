//! The crate's one error type.

use attention::AttentionError;
use kv_pool::KvPoolError;

/// Everything the model crate refuses. Bad input (a malformed checkpoint, a bad sampling
/// parameter, an inconsistent batch) is always one of these, never a panic.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON or not the expected structure.
    #[error("{file}: malformed JSON: {reason}")]
    Json {
        /// The file (or what it holds).
        file: String,
        /// The parser's message.
        reason: String,
    },
    /// A configuration field is missing, has the wrong type, or is out of range.
    #[error("config field `{field}`: {reason}")]
    ConfigField {
        /// The field's name as it appears in `config.json` (or the preset).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The checkpoint's `architectures` names a model this crate does not implement.
    #[error("unsupported architecture `{name}` (supported: {supported})")]
    UnsupportedArchitecture {
        /// The architecture named by the config.
        name: String,
        /// The architectures this crate implements, comma-separated.
        supported: String,
    },
    /// A tensor the architecture needs is absent from the checkpoint.
    #[error("missing tensor `{name}`")]
    MissingTensor {
        /// The tensor's name.
        name: String,
    },
    /// A tensor has a different shape from the one the config implies.
    #[error("tensor `{name}`: expected shape {expected:?}, got {got:?}")]
    TensorShape {
        /// The tensor's name.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the checkpoint.
        got: Vec<usize>,
    },
    /// A tensor has an element type the loader does not convert (only bf16, f16, f32 are).
    #[error("tensor `{name}`: unsupported dtype {dtype} (supported: BF16, F16, F32)")]
    TensorDtype {
        /// The tensor's name.
        name: String,
        /// The dtype in the checkpoint.
        dtype: String,
    },
    /// A checkpoint file is truncated, corrupt or inconsistent with its index.
    #[error("corrupt checkpoint {file}: {reason}")]
    CorruptCheckpoint {
        /// The file.
        file: String,
        /// What is wrong.
        reason: String,
    },
    /// The attention backend refused an operation.
    #[error("backend: {0}")]
    Attention(#[from] AttentionError),
    /// The KV pool refused a layout or an operation.
    #[error("kv pool: {0}")]
    KvPool(#[from] KvPoolError),
    /// The tokenizer could not be loaded or failed to encode / decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A chat template could not be parsed or rendered.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A sampling parameter is out of range.
    #[error("sampling parameter `{field}`: {reason}")]
    InvalidSampling {
        /// The parameter.
        field: &'static str,
        /// Why it is refused.
        reason: String,
    },
    /// A logits row holds NaN or +∞, or nothing finite: the forward pass that computed it broke
    /// (an overflow, or a NaN in the weights or the KV cache), so no token can be sampled from
    /// it.
    #[error(
        "the logits row holds {nan} NaN, {pos_inf} +inf and {neg_inf} -inf of {len} values: \
         the forward pass produced non-finite values"
    )]
    NonFiniteLogits {
        /// NaN values in the row.
        nan: usize,
        /// +∞ values in the row.
        pos_inf: usize,
        /// −∞ values in the row (a masked token, allowed while some value is finite).
        neg_inf: usize,
        /// The row's length.
        len: usize,
    },
    /// A forward input is inconsistent (token ids, slots and lengths disagree).
    #[error("request {request}: {reason}")]
    InvalidInput {
        /// Index of the request in the batch.
        request: usize,
        /// What is wrong.
        reason: String,
    },
    /// A KV load-back this pass waits on failed (HiCache), so layer `layer` cannot be read.
    #[error("layer {layer}: KV load-back failed: {reason}")]
    LayerWait {
        /// The layer the pass was about to compute.
        layer: usize,
        /// Why the load failed.
        reason: String,
    },
}

/// The crate's result type.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
