//! Tokenizers (a Hugging Face `tokenizer.json` through the pure-Rust `tokenizers` crate, or a
//! tiktoken encoding shipped inside `tiktoken-rs`), streaming detokenization that never splits
//! a UTF-8 character, and chat templates from `tokenizer_config.json` (Jinja via `minijinja`).

use std::fmt;
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use crate::error::{ModelError, Result};

/// Which tiktoken encoding (all ship inside `tiktoken-rs`; nothing is downloaded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TiktokenEncoding {
    /// GPT-2 / GPT-3 `r50k_base` (50,257 tokens; `<|endoftext|>` = 50256).
    R50kBase,
    /// `cl100k_base` (GPT-3.5 / GPT-4).
    Cl100kBase,
}

/// A tokenizer: Hugging Face `tokenizer.json` or a built-in tiktoken encoding.
pub enum Tokenizer {
    /// A Hugging Face tokenizer.
    HuggingFace(Box<tokenizers::Tokenizer>),
    /// A tiktoken encoding.
    Tiktoken {
        /// Which encoding.
        encoding: TiktokenEncoding,
        /// The BPE (a process-wide singleton inside `tiktoken-rs`).
        bpe: &'static tiktoken_rs::CoreBPE,
    },
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tokenizer::HuggingFace(t) => write!(
                f,
                "Tokenizer::HuggingFace(vocab {})",
                t.get_vocab_size(true)
            ),
            Tokenizer::Tiktoken { encoding, .. } => write!(f, "Tokenizer::Tiktoken({encoding:?})"),
        }
    }
}

fn tok_err(e: impl fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let t = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Tokenizer::HuggingFace(Box::new(t)))
    }

    /// Parses the JSON text of a Hugging Face `tokenizer.json`.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Self> {
        let t = tokenizers::Tokenizer::from_bytes(bytes).map_err(tok_err)?;
        Ok(Tokenizer::HuggingFace(Box::new(t)))
    }

    /// A built-in tiktoken encoding (no files, no network).
    pub fn tiktoken(encoding: TiktokenEncoding) -> Self {
        let bpe = match encoding {
            TiktokenEncoding::R50kBase => tiktoken_rs::r50k_base_singleton(),
            TiktokenEncoding::Cl100kBase => tiktoken_rs::cl100k_base_singleton(),
        };
        Tokenizer::Tiktoken { encoding, bpe }
    }

    /// Token ids of `text`. With a Hugging Face tokenizer, `add_special_tokens` applies its
    /// post-processor (e.g. a BOS); special-token text is recognised in both kinds.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        match self {
            Tokenizer::HuggingFace(t) => Ok(t
                .encode(text, add_special_tokens)
                .map_err(tok_err)?
                .get_ids()
                .to_vec()),
            Tokenizer::Tiktoken { bpe, .. } => Ok(bpe.encode_with_special_tokens(text)),
        }
    }

    /// Text of `ids`; bytes that do not form valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        match self {
            Tokenizer::HuggingFace(t) => t.decode(ids, skip_special_tokens).map_err(tok_err),
            Tokenizer::Tiktoken { bpe, .. } => {
                let bytes = bpe.decode_bytes(ids).map_err(tok_err)?;
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }

    /// Vocabulary size, added/special tokens included.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::HuggingFace(t) => t.get_vocab_size(true),
            Tokenizer::Tiktoken { encoding, .. } => match encoding {
                TiktokenEncoding::R50kBase => 50_257,
                TiktokenEncoding::Cl100kBase => 100_277,
            },
        }
    }

    /// The id of a token's text (special tokens included), if it is one token.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match self {
            Tokenizer::HuggingFace(t) => t.token_to_id(token),
            Tokenizer::Tiktoken { bpe, .. } => match bpe.encode_with_special_tokens(token)[..] {
                [id] => Some(id),
                _ => None,
            },
        }
    }
}

/// Streaming detokenization for one request (the offsets scheme of HF TGI / SGLang).
///
/// Text is emitted only once it is stable: the decoder re-decodes a short window
/// (`ids[prefix_offset..]`) and holds back output while it ends in U+FFFD, i.e. while the
/// last tokens end inside a multi-byte UTF-8 character. The concatenation of every
/// [`step`](Self::step) and the final [`finish`](Self::finish) equals `decode(all ids)`.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    /// A decoder with no tokens yet.
    pub fn new(skip_special_tokens: bool) -> Self {
        IncrementalDecoder {
            skip_special_tokens,
            ..Default::default()
        }
    }

    /// Every id pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Adds one generated token; returns the newly stable text (possibly empty).
    pub fn step(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let skip = self.skip_special_tokens;
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], skip)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            let delta = if full.starts_with(&prefix) {
                full[prefix.len()..].to_string()
            } else {
                // The window's text changed before the cut (a tokenizer whose decoding of a
                // prefix depends on what follows); emit the part after the common prefix.
                let common = full
                    .char_indices()
                    .zip(prefix.chars())
                    .find(|((_, a), b)| a != b)
                    .map(|((i, _), _)| i)
                    .unwrap_or(prefix.len().min(full.len()));
                full[common..].to_string()
            };
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Flushes what is held back at the end of generation (incomplete bytes become U+FFFD).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        let skip = self.skip_special_tokens;
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], skip)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A chat template (Jinja) with the special tokens it may refer to, rendered like
/// `transformers`' `apply_chat_template` (`trim_blocks` and `lstrip_blocks` on,
/// `raise_exception` available).
#[derive(Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

fn special_token(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

fn jinja_err(e: minijinja::Error) -> ModelError {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    ModelError::ChatTemplate(msg)
}

impl ChatTemplate {
    /// Compiles `source` (syntax errors are reported here).
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(syntax.build().map_err(jinja_err)?);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(jinja_err)?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// Reads `chat_template` (a string, or a list of `{name, template}` where `default` is
    /// taken), `bos_token` and `eos_token` from the JSON text of a `tokenizer_config.json`.
    /// `Ok(None)` when the config has no template.
    pub fn from_tokenizer_config(json: &str) -> Result<Option<Self>> {
        let v: Value = serde_json::from_str(json).map_err(|e| ModelError::Json {
            file: "tokenizer_config.json".into(),
            reason: e.to_string(),
        })?;
        let source = match v.get("chat_template") {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .ok_or_else(|| ModelError::ConfigField {
                    field: "chat_template".into(),
                    reason: "a list without a usable `template`".into(),
                })?
                .to_string(),
            Some(other) => {
                return Err(ModelError::ConfigField {
                    field: "chat_template".into(),
                    reason: format!("expected a string or a list, got {other}"),
                })
            }
        };
        Self::new(
            &source,
            &special_token(v.get("bos_token")),
            &special_token(v.get("eos_token")),
        )
        .map(Some)
    }

    /// Renders the conversation; with `add_generation_prompt` the template appends the
    /// assistant turn's opening.
    pub fn apply(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template("chat").map_err(jinja_err)?;
        tmpl.render(minijinja::context! {
            messages => minijinja::value::Serde(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        })
        .map_err(jinja_err)
    }
}
