//! The request bodies the router sends: SGLang's bootstrap fields injected into the client's
//! JSON (SGLang's `bootstrap_injector.rs`), and the prefill server's copy.
//!
//! A single request gets `bootstrap_host` (the prefill URL's host), `bootstrap_port` and one
//! `bootstrap_room`; a batch (a list `text` / `input_ids` / `prompt`, or `n > 1`) gets a list
//! of each, one room per item, as SGLang's router. Both servers receive the same fields. The
//! prefill copy is the same body with `stream: false` and no `stream_options`: the router
//! reads the prefill's cached-token count from its one JSON answer and streams only decode's.

use serde_json::{Map, Value};

use super::policy::RoomGenerator;

/// Why a body cannot be routed (a 400 naming `param`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadBody {
    /// The field at fault (`None`: the body itself).
    pub param: Option<&'static str>,
    /// What is wrong.
    pub message: String,
}

/// Parses a client's body: a JSON object.
pub fn parse_body(bytes: &[u8]) -> Result<Map<String, Value>, BadBody> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(BadBody {
            param: None,
            message: "the body must be a JSON object".into(),
        }),
        Err(e) => Err(BadBody {
            param: None,
            message: format!("the body is not valid JSON: {e}"),
        }),
    }
}

/// How many generations a body asks for: `None` for one, `Some(n)` for a batch of `n`
/// (SGLang's `extract_batch_size`: `n > 1`, then a list `prompt`, `text` or `input_ids`; a
/// list of token ids is one prompt).
pub fn batch_size(body: &Map<String, Value>) -> Result<Option<usize>, BadBody> {
    if let Some(n) = body.get("n").and_then(Value::as_u64) {
        if n > 1 {
            return Ok(Some(n as usize));
        }
    }
    for field in ["prompt", "text", "input_ids"] {
        if let Some(Value::Array(items)) = body.get(field) {
            if items.is_empty() {
                return Err(BadBody {
                    param: Some(field),
                    message: format!("`{field}` is an empty list"),
                });
            }
            // A list of numbers is one tokenized prompt, not a batch.
            if items.iter().all(Value::is_number) {
                return Ok(None);
            }
            return Ok(Some(items.len()));
        }
    }
    Ok(None)
}

/// The bootstrap fields a request carried: the rooms, one per batch item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    /// `bootstrap_room` of each item (one for a single request).
    pub rooms: Vec<u64>,
}

/// Sets `bootstrap_host`, `bootstrap_port` and `bootstrap_room` in `body` (replacing any the
/// client sent) for a prefill at `host:port`; lists for a batch of `batch` items.
pub fn inject_bootstrap(
    body: &mut Map<String, Value>,
    batch: Option<usize>,
    host: &str,
    port: u16,
    rooms: &RoomGenerator,
) -> Bootstrap {
    let drawn: Vec<u64> = (0..batch.unwrap_or(1)).map(|_| rooms.next_room()).collect();
    let (h, p, r) = match batch {
        None => (Value::from(host), Value::from(port), Value::from(drawn[0])),
        Some(n) => (
            Value::from(vec![host; n]),
            Value::from(vec![port; n]),
            Value::from(drawn.clone()),
        ),
    };
    body.insert("bootstrap_host".into(), h);
    body.insert("bootstrap_port".into(), p);
    body.insert("bootstrap_room".into(), r);
    Bootstrap { rooms: drawn }
}

/// Whether the client asked for a server-sent-event stream.
pub fn is_stream(body: &Map<String, Value>) -> bool {
    body.get("stream").and_then(Value::as_bool).unwrap_or(false)
}

/// The prefill server's copy of an injected body: not streamed.
pub fn prefill_body(body: &Map<String, Value>) -> Map<String, Value> {
    let mut copy = body.clone();
    if copy.contains_key("stream") {
        copy.insert("stream".into(), Value::Bool(false));
    }
    copy.remove("stream_options");
    copy
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn batches_are_lists_of_prompts_or_n() {
        assert_eq!(batch_size(&obj(json!({"text": "hi"}))).unwrap(), None);
        assert_eq!(
            batch_size(&obj(json!({"input_ids": [1, 2, 3]}))).unwrap(),
            None
        );
        assert_eq!(
            batch_size(&obj(json!({"input_ids": [[1], [2]]}))).unwrap(),
            Some(2)
        );
        assert_eq!(
            batch_size(&obj(json!({"prompt": ["a", "b", "c"]}))).unwrap(),
            Some(3)
        );
        assert_eq!(
            batch_size(&obj(json!({"messages": [], "n": 4}))).unwrap(),
            Some(4)
        );
        assert_eq!(
            batch_size(&obj(json!({"n": 1, "prompt": "x"}))).unwrap(),
            None
        );
        let e = batch_size(&obj(json!({"text": []}))).unwrap_err();
        assert_eq!(e.param, Some("text"));
    }

    #[test]
    fn injection_replaces_client_fields_and_prefill_is_not_streamed() {
        let rooms = RoomGenerator::default();
        let mut b = obj(json!({"text": "hi", "bootstrap_room": 5, "stream": true,
            "stream_options": {"include_usage": true}}));
        let boot = inject_bootstrap(&mut b, None, "10.0.0.1", 8998, &rooms);
        assert_eq!(b["bootstrap_host"], json!("10.0.0.1"));
        assert_eq!(b["bootstrap_port"], json!(8998));
        assert_eq!(b["bootstrap_room"], json!(boot.rooms[0]));
        let p = prefill_body(&b);
        assert_eq!(
            (p["stream"].clone(), p.get("stream_options")),
            (json!(false), None)
        );
        assert_eq!(p["bootstrap_room"], b["bootstrap_room"]);

        let mut batch = obj(json!({"text": ["a", "b"]}));
        let boot = inject_bootstrap(&mut batch, Some(2), "h", 1, &rooms);
        assert_eq!(batch["bootstrap_host"], json!(["h", "h"]));
        assert_eq!(batch["bootstrap_port"], json!([1, 1]));
        assert_eq!(batch["bootstrap_room"], json!(boot.rooms));
        assert_ne!(boot.rooms[0], boot.rooms[1]);
    }
}
