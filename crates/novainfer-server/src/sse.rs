//! Server-sent events framing, as OpenAI streams them: one `data: <json>` event per chunk,
//! `: keep-alive` comments while nothing happens, and `data: [DONE]` last.
//!
//! Invariant: JSON is serialized without raw newlines (serde_json escapes them inside
//! strings), so every event is exactly one `data:` line followed by a blank line.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde::Serialize;

/// A `text/event-stream` response of `body`'s events.
pub fn response(body: impl futures_util::Stream<Item = Bytes> + Send + 'static) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body.map(Ok::<_, Infallible>)),
    )
        .into_response()
}

pub fn data<T: Serialize>(value: &T) -> Bytes {
    let json = serde_json::to_string(value).unwrap_or_else(|e| {
        // Serializing our own response types cannot fail; if it ever does, say so in-band.
        format!(r#"{{"error":{{"message":"cannot serialize a chunk: {e}","type":"server_error","param":null,"code":null}}}}"#)
    });
    Bytes::from(format!("data: {json}\n\n"))
}

/// A named event (`event: <name>` then its `data:` line), as the Responses and Anthropic
/// streams send them: their clients dispatch on the name.
pub fn named<T: Serialize>(name: &str, value: &T) -> Bytes {
    let data = data(value);
    let mut out = Vec::with_capacity(data.len() + name.len() + 8);
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.push(b'\n');
    out.extend_from_slice(&data);
    Bytes::from(out)
}

pub fn done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

pub fn keep_alive() -> Bytes {
    Bytes::from_static(b": keep-alive\n\n")
}

/// The `(event name, data)` of each named event; checks that the data's `type` is the name.
#[cfg(test)]
pub(crate) fn parse_named(events: &[Bytes]) -> Vec<(String, serde_json::Value)> {
    events
        .iter()
        .map(|e| {
            let text = std::str::from_utf8(e).expect("utf-8");
            let (head, data) = text.split_once('\n').expect("two lines");
            let name = head.strip_prefix("event: ").expect("named").to_owned();
            let data: serde_json::Value =
                serde_json::from_str(data.trim_end().strip_prefix("data: ").expect("data line"))
                    .expect("json");
            assert_eq!(data["type"], serde_json::Value::from(name.as_str()));
            (name, data)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_event_even_with_newlines_in_text() {
        let event = data(&serde_json::json!({"text": "a\nb\r\n"}));
        let s = std::str::from_utf8(&event).expect("valid test input");
        assert_eq!(s, "data: {\"text\":\"a\\nb\\r\\n\"}\n\n");
        assert_eq!(s.matches('\n').count(), 2);
    }

    #[test]
    fn named_events_put_the_name_first() {
        let event = named("message_stop", &serde_json::json!({"type": "message_stop"}));
        assert_eq!(
            &event[..],
            b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
        );
    }

    #[test]
    fn done_and_comments() {
        assert_eq!(&done()[..], b"data: [DONE]\n\n");
        assert!(keep_alive().starts_with(b":"));
    }
}
