//! OpenAI chat messages to a prompt: the `messages` schema (roles `system` / `developer`,
//! `user`, `assistant`; string content or a list of `{"type": "text", "text"}` parts) and the
//! chat template that renders them — the model's own (`tokenizer_config.json`), or, for a
//! model without one (the tiny preset), [`FALLBACK_CHAT_TEMPLATE`], ChatML:
//!
//! ```text
//! <|im_start|>system
//! You are helpful.<|im_end|>
//! <|im_start|>user
//! Hi<|im_end|>
//! <|im_start|>assistant
//! ```
//!
//! With the fallback, `<|im_end|>` is also a stop string. `/get_model_info` says which
//! template is in use.

use model::{ChatMessage, ChatTemplate};
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;

/// The template used when the model has none: ChatML.
pub const FALLBACK_CHAT_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The stop string the fallback template's turns end with.
const FALLBACK_STOP: &str = "<|im_end|>";

/// One message of a chat request.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    /// A participant name; accepted and not used.
    #[serde(default)]
    #[allow(dead_code)]
    name: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "expected a string or an array of {\"type\": \"text\", \"text\": …} parts"
)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

/// The chat template the server renders conversations with.
#[derive(Debug)]
pub struct ChatPrompt {
    template: ChatTemplate,
    fallback: bool,
}

impl ChatPrompt {
    /// The model's template, or the ChatML fallback when it has none.
    pub fn new(model_template: Option<ChatTemplate>) -> model::Result<Self> {
        Ok(match model_template {
            Some(template) => ChatPrompt {
                template,
                fallback: false,
            },
            None => ChatPrompt {
                template: ChatTemplate::new(FALLBACK_CHAT_TEMPLATE, "", "")?,
                fallback: true,
            },
        })
    }

    /// Which template is in use, for `/get_model_info`.
    pub fn describe(&self) -> Value {
        if self.fallback {
            json!({"source": "fallback", "format": "chatml", "stop": [FALLBACK_STOP]})
        } else {
            json!({"source": "model"})
        }
    }

    /// Stop strings the template implies.
    pub fn stop_strings(&self) -> &'static [&'static str] {
        if self.fallback {
            &[FALLBACK_STOP]
        } else {
            &[]
        }
    }

    /// The prompt for `messages`, ending with the assistant turn's opening.
    pub fn render(&self, messages: &[Message]) -> Result<String, ApiError> {
        if messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages is empty"));
        }
        let msgs = messages
            .iter()
            .enumerate()
            .map(|(i, m)| to_chat_message(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        self.template.apply(&msgs, true).map_err(|e| {
            ApiError::invalid(
                "messages",
                format!("the chat template refused the messages: {e}"),
            )
        })
    }
}

fn to_chat_message(i: usize, m: &Message) -> Result<ChatMessage, ApiError> {
    let param = || format!("messages[{i}]");
    let role = match m.role.as_str() {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        other => {
            return Err(ApiError::invalid(
                format!("{}.role", param()),
                format!(
                    "messages[{i}].role: `{other}` is not supported; use system, user or assistant"
                ),
            ))
        }
    };
    let content = match &m.content {
        None => String::new(),
        Some(Content::Text(t)) => t.clone(),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for (k, p) in parts.iter().enumerate() {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => text.push_str(t),
                    ("text", None) => {
                        return Err(ApiError::invalid(
                            format!("{}.content[{k}].text", param()),
                            format!("messages[{i}].content[{k}] has no text"),
                        ))
                    }
                    (other, _) => {
                        return Err(ApiError::unsupported(
                            &format!("{}.content[{k}].type", param()),
                            format!(
                                "messages[{i}].content[{k}]: content of type `{other}` is not supported; only text"
                            ),
                        ))
                    }
                }
            }
            text
        }
    };
    Ok(ChatMessage::new(role, content))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fallback_template_is_chatml() {
        let chat = ChatPrompt::new(None).unwrap();
        let msgs: Vec<Message> = serde_json::from_value(json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
        ]))
        .unwrap();
        insta::assert_snapshot!(chat.render(&msgs).unwrap(), @r###"
        <|im_start|>system
        Be brief.<|im_end|>
        <|im_start|>user
        Hi!<|im_end|>
        <|im_start|>assistant
        "###);
        assert_eq!(chat.stop_strings(), &["<|im_end|>"]);
    }
}
