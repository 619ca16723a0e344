//! Merging the prefill's cached-token count into decode's answer, and reading decode's
//! server-sent-event stream one event at a time.
//!
//! In PD serving the prefill server computes the prompt, so the tokens it found in its prefix
//! cache are the request's cached tokens; the decode server only receives KV. The router
//! therefore writes the prefill's count over decode's wherever decode's answer carries one:
//! `meta_info.cached_tokens` (SGLang's `/generate`) and `usage.prompt_tokens_details.
//! cached_tokens` (the OpenAI endpoints). A field decode's answer does not have is not added.

use serde_json::Value;

/// Where a response carries its cached-token count.
const PATHS: [&[&str]; 2] = [
    &["meta_info", "cached_tokens"],
    &["usage", "prompt_tokens_details", "cached_tokens"],
];

/// The prefill's cached-token counts: one per answer object (a batch `/generate` answers a
/// list); `None` where the prefill's answer has none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillCached {
    /// The prefill answered one object.
    One(Option<u64>),
    /// The prefill answered a list (a batch), one count per item.
    Batch(Vec<Option<u64>>),
}

impl PrefillCached {
    /// Reads the counts from the prefill's JSON answer.
    pub fn from_answer(prefill: &Value) -> Self {
        match prefill {
            Value::Array(items) => PrefillCached::Batch(items.iter().map(find).collect()),
            v => PrefillCached::One(find(v)),
        }
    }
}

fn find(v: &Value) -> Option<u64> {
    PATHS
        .iter()
        .find_map(|path| path.iter().try_fold(v, |v, k| v.get(k))?.as_u64())
}

/// Whether `v` (an object, or a list of them) carries a cached-token count.
pub fn has_cached(v: &Value) -> bool {
    match v {
        Value::Array(items) => items.iter().any(has_cached),
        v => PATHS.iter().any(|path| {
            path.iter()
                .try_fold(v, |v, k| v.get(k))
                .is_some_and(Value::is_number)
        }),
    }
}

/// The number at `path` in `v`, if there is one there.
fn slot<'a>(v: &'a mut Value, path: &[&str]) -> Option<&'a mut Value> {
    let target = path.iter().try_fold(v, |v, k| v.get_mut(*k))?;
    target.is_number().then_some(target)
}

fn set(v: &mut Value, count: Option<u64>) {
    let Some(count) = count else { return };
    for path in PATHS {
        if let Some(s) = slot(v, path) {
            *s = Value::from(count);
        }
    }
}

/// Writes the prefill's counts over decode's in `decode` (see the module doc). A list answer
/// takes the prefill's counts item by item; a single count applies to every item.
pub fn merge_cached(decode: &mut Value, prefill: &PrefillCached) {
    match (decode, prefill) {
        (Value::Array(items), PrefillCached::Batch(counts)) => {
            for (item, count) in items.iter_mut().zip(counts) {
                set(item, *count);
            }
        }
        (Value::Array(items), PrefillCached::One(count)) => {
            items.iter_mut().for_each(|item| set(item, *count));
        }
        (v, PrefillCached::One(count)) => set(v, *count),
        // One decode object for a batch prefill: the counts do not line up; leave it.
        (_, PrefillCached::Batch(_)) => {}
    }
}

/// One server-sent event, as the decode server sent it.
#[derive(Debug, Clone, PartialEq)]
pub enum SseEvent {
    /// `data: [DONE]`, comments, or anything without data: passed on as is.
    Verbatim(Vec<u8>),
    /// A JSON data event: its other lines (`event:`, `id:`) and the parsed data.
    Json {
        other_lines: Vec<String>,
        data: Value,
    },
}

/// A data event whose data is not JSON: the text, for the error naming the worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotJson(pub String);

impl SseEvent {
    /// Parses one event (the bytes before and including its blank line).
    pub fn parse(raw: &[u8]) -> Result<Self, NotJson> {
        let text = String::from_utf8_lossy(raw);
        let mut data: Vec<&str> = Vec::new();
        let mut other_lines = Vec::new();
        for line in text.lines() {
            if let Some(d) = line.strip_prefix("data:") {
                data.push(d.strip_prefix(' ').unwrap_or(d));
            } else if !line.is_empty() {
                other_lines.push(line.to_string());
            }
        }
        let payload = data.join("\n");
        if data.is_empty() || payload.trim() == "[DONE]" {
            return Ok(SseEvent::Verbatim(raw.to_vec()));
        }
        match serde_json::from_str(&payload) {
            Ok(data) => Ok(SseEvent::Json { other_lines, data }),
            Err(_) => Err(NotJson(payload)),
        }
    }

    /// The event as bytes on the wire.
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            SseEvent::Verbatim(b) => b.clone(),
            SseEvent::Json { other_lines, data } => {
                let mut s = String::new();
                for l in other_lines {
                    s.push_str(l);
                    s.push('\n');
                }
                s.push_str("data: ");
                s.push_str(&data.to_string());
                s.push_str("\n\n");
                s.into_bytes()
            }
        }
    }
}

/// Takes the first complete event (up to and including its blank line) off `buf`.
pub fn take_event(buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let lf = find_bytes(buf, b"\n\n").map(|i| i + 2);
    let crlf = find_bytes(buf, b"\r\n\r\n").map(|i| i + 4);
    let end = match (lf, crlf) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => a.or(b)?,
    };
    let rest = buf.split_off(end);
    Some(std::mem::replace(buf, rest))
}

fn find_bytes(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    proptest! {
        /// However decode's stream is cut into chunks, the relay takes the same events off
        /// its buffer, each whole, in order, and keeps an unterminated tail.
        #[test]
        fn events_survive_any_chunking(
            texts in proptest::collection::vec("[a-z{}\":, ]{0,12}", 0..8),
            crlf in proptest::collection::vec(any::<bool>(), 8),
            cuts in proptest::collection::vec(0usize..200, 0..12),
            tail in "[a-z]{0,5}",
        ) {
            let events: Vec<Vec<u8>> = texts
                .iter()
                .zip(&crlf)
                .map(|(t, &c)| format!("data: {t}{}", if c { "\r\n\r\n" } else { "\n\n" }).into_bytes())
                .collect();
            let mut wire: Vec<u8> = events.concat();
            wire.extend_from_slice(tail.as_bytes());
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(wire.len())).collect();
            cuts.sort_unstable();
            cuts.push(wire.len());
            let (mut buf, mut got, mut start) = (Vec::new(), Vec::new(), 0);
            for end in cuts {
                buf.extend_from_slice(&wire[start..end]);
                start = end;
                while let Some(e) = take_event(&mut buf) {
                    got.push(e);
                }
            }
            prop_assert_eq!(got, events);
            prop_assert_eq!(buf, tail.into_bytes());
        }
    }

    #[test]
    fn prefill_counts_replace_decode_counts_where_decode_has_them() {
        let p = PrefillCached::from_answer(&json!({"meta_info": {"cached_tokens": 48}}));
        assert_eq!(p, PrefillCached::One(Some(48)));
        let mut d = json!({"text": "x", "meta_info": {"cached_tokens": 0, "prompt_tokens": 64}});
        merge_cached(&mut d, &p);
        assert_eq!(
            d["meta_info"],
            json!({"cached_tokens": 48, "prompt_tokens": 64})
        );

        let p = PrefillCached::from_answer(
            &json!({"usage": {"prompt_tokens_details": {"cached_tokens": 16}}}),
        );
        let mut chunk = json!({"choices": [], "usage": null});
        assert!(!has_cached(&chunk));
        merge_cached(&mut chunk, &p);
        assert_eq!(chunk["usage"], Value::Null);
        let mut last = json!({"usage": {"prompt_tokens_details": {"cached_tokens": 0}}});
        assert!(has_cached(&last));
        merge_cached(&mut last, &p);
        assert_eq!(
            last["usage"]["prompt_tokens_details"]["cached_tokens"],
            json!(16)
        );

        let p = PrefillCached::from_answer(&json!([
            {"meta_info": {"cached_tokens": 1}}, {"meta_info": {}}
        ]));
        let mut d =
            json!([{"meta_info": {"cached_tokens": 0}}, {"meta_info": {"cached_tokens": 7}}]);
        merge_cached(&mut d, &p);
        assert_eq!(
            d,
            json!([{"meta_info": {"cached_tokens": 1}}, {"meta_info": {"cached_tokens": 7}}])
        );
    }

    #[test]
    fn events_split_on_blank_lines_and_keep_their_other_lines() {
        let mut buf = b"data: {\"a\":1}\n\nevent: x\r\ndata: [DONE]\r\n\r\ndata: {\"b\"".to_vec();
        let first = take_event(&mut buf).unwrap();
        assert_eq!(first, b"data: {\"a\":1}\n\n");
        let second = take_event(&mut buf).unwrap();
        assert_eq!(
            SseEvent::parse(&second).unwrap(),
            SseEvent::Verbatim(second.clone())
        );
        assert_eq!(take_event(&mut buf), None);
        assert_eq!(buf, b"data: {\"b\"");
        let e = SseEvent::parse(b"id: 3\ndata: {\"v\": 2}\n\n").unwrap();
        assert_eq!(e.to_bytes(), b"id: 3\ndata: {\"v\":2}\n\n");
        assert_eq!(
            SseEvent::parse(b"data: oops\n\n"),
            Err(NotJson("oops".into()))
        );
    }
}
