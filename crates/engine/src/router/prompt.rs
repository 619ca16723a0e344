//! What a request's body says to route on ([`routing_prompt`], sgl-router's
//! `get_text_for_routing`): `/generate`'s `input_ids` or `text`, `/v1/completions`' `prompt`
//! (text or token ids), `/v1/chat/completions`' message contents. For a batch, its first
//! item (a batch goes to one worker). With the workers' tokenizer ([`PromptEncoder`],
//! `--tokenizer-path`), text is turned into the token ids a worker will prefill, exactly as the
//! worker does it (the same tokenizer call, the same chat template), so the policies that key
//! on real cached pages (`kv_events`) can match text prompts too.

use serde_json::{Map, Value};

use super::policies::Prompt;
use crate::error::{EngineError, Result};
use crate::server::chat::{ChatPrompt, Message};
use crate::setup::source::ModelSource;

/// The workers' tokenizer and chat template, for routing text on token ids.
#[derive(Debug)]
pub struct PromptEncoder {
    tokenizer: model::Tokenizer,
    chat: ChatPrompt,
}

impl PromptEncoder {
    /// The tokenizer (and chat template, or the ChatML fallback) of `source`, as `kvserve
    /// serve --model-path` loads them.
    pub fn load(source: &ModelSource) -> Result<Self> {
        let (tokenizer, template) = source.tokenizer()?;
        let chat = ChatPrompt::new(template).map_err(|e| EngineError::Model(e.to_string()))?;
        Ok(PromptEncoder { tokenizer, chat })
    }

    /// `/generate`'s `text` and `/v1/completions`' `prompt`: the tokenizer's special tokens
    /// added, as the worker encodes them (text that does not encode routes as text).
    fn text(&self, text: String) -> Prompt {
        match self.tokenizer.encode(&text, true) {
            Ok(ids) => Prompt::Tokens(ids),
            Err(_) => Prompt::Text(text),
        }
    }

    /// A chat's `messages` rendered by the template, then encoded without special tokens (the
    /// template has them), as the worker does; `None` if the worker would refuse them.
    fn chat(&self, messages: &Value) -> Option<Prompt> {
        let messages: Vec<Message> = serde_json::from_value(messages.clone()).ok()?;
        let text = self.chat.render(&messages).ok()?;
        self.tokenizer.encode(&text, false).ok().map(Prompt::Tokens)
    }
}

/// Token ids from a JSON list of numbers (`None` if it is not one).
fn ids(items: &[Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// A `text`, `prompt` or `input_ids` value: a string, a list of token ids, or a batch of
/// either (its first item).
fn from_value(v: &Value) -> Prompt {
    match v {
        Value::String(s) => Prompt::Text(s.clone()),
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_number) => {
            ids(items).map_or(Prompt::Empty, Prompt::Tokens)
        }
        Value::Array(items) => items.first().map_or(Prompt::Empty, |first| match first {
            Value::Array(_) | Value::String(_) => from_value(first),
            _ => Prompt::Empty,
        }),
        _ => Prompt::Empty,
    }
}

/// The text of one chat message's `content`: a string, or the `text` of its parts.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// What `body` (at `route`) routes on: token ids where the body has them or `encoder` makes
/// them, else its text.
pub fn routing_prompt(
    route: &str,
    body: &Map<String, Value>,
    encoder: Option<&PromptEncoder>,
) -> Prompt {
    let prompt = body_prompt(route, body, encoder);
    match (prompt, encoder) {
        (Prompt::Text(text), Some(e)) if route != "/v1/chat/completions" => e.text(text),
        (prompt, _) => prompt,
    }
}

/// What `body` says, token ids only where it gives them (or, for a chat, `encoder` renders
/// and encodes them).
fn body_prompt(route: &str, body: &Map<String, Value>, encoder: Option<&PromptEncoder>) -> Prompt {
    let field = |k: &str| body.get(k).map_or(Prompt::Empty, from_value);
    match route {
        "/v1/chat/completions" => {
            let messages = body.get("messages");
            if let Some(tokens) = encoder.zip(messages).and_then(|(e, m)| e.chat(m)) {
                return tokens;
            }
            match messages {
                Some(Value::Array(msgs)) => Prompt::Text(
                    msgs.iter()
                        .filter_map(|m| m.get("content"))
                        .map(content_text)
                        .collect::<Vec<_>>()
                        .join("\n"),
                ),
                _ => Prompt::Empty,
            }
        }
        "/v1/completions" => field("prompt"),
        _ => match field("input_ids") {
            Prompt::Empty => field("text"),
            p => p,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn of(route: &str, v: Value) -> Prompt {
        routing_prompt(route, v.as_object().unwrap(), None)
    }

    #[test]
    fn each_route_routes_on_its_prompt_field() {
        let text = |s: &str| Prompt::Text(s.into());
        assert_eq!(of("/generate", json!({"text": "hi"})), text("hi"));
        assert_eq!(of("/generate", json!({"text": ["a", "b"]})), text("a"));
        assert_eq!(
            of(
                "/generate",
                json!({"input_ids": [[1, 2], [3]], "text": "x"})
            ),
            Prompt::Tokens(vec![1, 2])
        );
        assert_eq!(
            of("/v1/completions", json!({"prompt": [5, 6]})),
            Prompt::Tokens(vec![5, 6])
        );
        assert_eq!(
            of("/v1/completions", json!({"prompt": [-1]})),
            Prompt::Empty
        );
        assert_eq!(
            of(
                "/v1/chat/completions",
                json!({"messages": [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
            ),
            text("be brief\nhi")
        );
        assert_eq!(of("/v1/completions", json!({})), Prompt::Empty);
    }

    #[test]
    fn with_the_workers_tokenizer_text_routes_on_the_ids_a_worker_prefills() {
        let e = PromptEncoder::load(&ModelSource::Tiny).unwrap();
        let (tok, template) = ModelSource::Tiny.tokenizer().unwrap();
        let chat = ChatPrompt::new(template).unwrap();
        let with = |route: &str, v: Value| routing_prompt(route, v.as_object().unwrap(), Some(&e));
        let ids = |s: &str, special: bool| Prompt::Tokens(tok.encode(s, special).unwrap());
        let text = "The quick brown fox jumps over the lazy dog";
        // /generate's text and a completion's text prompt: special tokens added, as the
        // worker's `encode(text, true)`; token ids in the body stay as they are.
        assert_eq!(with("/generate", json!({"text": text})), ids(text, true));
        assert_eq!(
            with("/generate", json!({"text": [text, "x"]})),
            ids(text, true)
        );
        assert_eq!(
            with("/v1/completions", json!({"prompt": text})),
            ids(text, true)
        );
        assert_eq!(
            with("/generate", json!({"input_ids": [7, 8], "text": text})),
            Prompt::Tokens(vec![7, 8])
        );
        // A chat: rendered by the template, then encoded without special tokens.
        let messages = json!([{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]);
        let parsed: Vec<Message> = serde_json::from_value(messages.clone()).unwrap();
        let rendered = chat.render(&parsed).unwrap();
        assert!(
            rendered.contains("be brief") && rendered.contains("hi"),
            "{rendered}"
        );
        assert_eq!(
            with("/v1/chat/completions", json!({"messages": messages})),
            ids(&rendered, false)
        );
        // Messages a worker would refuse route as their text, as without a tokenizer.
        assert_eq!(
            with(
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "hi", "extra": 1}]})
            ),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            with("/v1/chat/completions", json!({"messages": []})),
            Prompt::Text(String::new())
        );
        assert_eq!(with("/v1/completions", json!({})), Prompt::Empty);
    }

    #[test]
    fn a_tokenizer_path_is_a_directory_or_the_tiny_preset_and_a_bad_one_stops_the_router() {
        use std::path::{Path, PathBuf};
        assert_eq!(
            ModelSource::from_tokenizer_arg(Path::new("tiny")),
            ModelSource::Tiny
        );
        assert_eq!(
            ModelSource::from_tokenizer_arg(Path::new("/models/llama")),
            ModelSource::Path(PathBuf::from("/models/llama"))
        );
        let mut cfg = crate::router::RouterConfig::regular(
            &["http://127.0.0.1:1"],
            crate::router::PolicyKind::KvEvents,
        )
        .unwrap();
        cfg.tokenizer = Some(ModelSource::Path("/nonexistent/model".into()));
        let err = crate::router::RouterState::new(cfg)
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/model"), "{err}");
    }
}
