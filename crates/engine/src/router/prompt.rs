//! What a request's body says to route on ([`routing_prompt`], sgl-router's
//! `get_text_for_routing`): `/generate`'s `input_ids` or `text`, `/v1/completions`' `prompt`
//! (text or token ids), `/v1/chat/completions`' message contents. For a batch, its first
//! item (a batch goes to one worker).

use serde_json::{Map, Value};

use super::policies::Prompt;

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

/// What `body` (at `route`) routes on.
pub fn routing_prompt(route: &str, body: &Map<String, Value>) -> Prompt {
    let field = |k: &str| body.get(k).map_or(Prompt::Empty, from_value);
    match route {
        "/v1/chat/completions" => match body.get("messages") {
            Some(Value::Array(msgs)) => Prompt::Text(
                msgs.iter()
                    .filter_map(|m| m.get("content"))
                    .map(content_text)
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
            _ => Prompt::Empty,
        },
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
        routing_prompt(route, v.as_object().unwrap())
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
}
