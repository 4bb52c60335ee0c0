//! The streaming parser of Hermes tool calls, the format Qwen2.5 is trained on:
//!
//! ```text
//! Let me look that up.
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! Text arrives in arbitrary pieces; the parser turns it into [`ToolEvent`]s: content, the
//! start of a call (once its name is read), then its arguments' JSON text as it comes. What
//! it reports depends only on the text, never on where the pieces were cut (the unit tests
//! try every cut), so a stream reassembles into exactly the non-streamed answer:
//!
//! - a partial `<tool_call>` at the end of a piece is held back, and flushed as content if
//!   the output ends there;
//! - a call is recognised once `{"name": <string>, "arguments":` follows the tag (the order
//!   the chat template shows the model and the tool grammar enforces); a block that does not
//!   start that way is content, tag included;
//! - small models often write the call without its tags: an output (or the text after a call)
//!   that opens with `{"name": <string>, "arguments":` is a bare call, ending at its `}` (the
//!   `auto` tool grammar treats such outputs the same way);
//! - arguments are passed on only as far as they stay valid JSON ([`JsonPrefix`]), so a
//!   `</tool_call>` or `}` inside a string does not end them. If they break, the call ends
//!   there and the rest is content; if the output ends inside them (`max_tokens`), the call
//!   keeps what it has;
//! - the `}` and `</tool_call>` closing a call are dropped, and so is whitespace between and
//!   after calls; other text after a call is content.

use super::json_prefix::{Feed, JsonPrefix};
use crate::reasoning::partial_tag_len;

pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    Content(String),
    /// A call begins: its position among the output's calls, and the function's name.
    CallStart {
        index: usize,
        name: String,
    },
    /// More of call `index`'s arguments (JSON text, as the model wrote it).
    Arguments {
        index: usize,
        text: String,
    },
}

#[derive(Debug)]
enum State {
    /// At the start of the output or after a call: the whitespace read so far (a `{` next
    /// opens a bare call).
    Start(String),
    Text,
    /// The text read so far of a call's head; `tagged`: after `<tool_call>`, else a bare call
    /// after `lead` (whitespace, content if this is no call).
    Head {
        buf: String,
        tagged: bool,
        lead: String,
    },
    Arguments {
        json: JsonPrefix,
        started: bool,
        tagged: bool,
    },
    /// After the arguments: the text read so far of `}` (and `</tool_call>`, `tagged`).
    Tail {
        buf: String,
        tagged: bool,
    },
}

/// How far a text matches a pattern it must start with.
#[derive(Debug, PartialEq, Eq)]
enum Match<T> {
    /// All of it fits; more text is needed.
    Partial,
    No,
    /// Matched, ending at this byte offset.
    Yes(usize, T),
}

/// Reads a fixed text or JSON whitespace off the front of `rest`.
struct Cursor<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Cursor<'a> {
    fn ws(&mut self) {
        let rest = &self.text[self.at..];
        self.at += rest.len() - rest.trim_start_matches([' ', '\t', '\n', '\r']).len();
    }

    fn literal<T>(&mut self, lit: &str) -> Option<Match<T>> {
        let rest = &self.text[self.at..];
        if rest.starts_with(lit) {
            self.at += lit.len();
            None
        } else if lit.starts_with(rest) {
            Some(Match::Partial)
        } else {
            Some(Match::No)
        }
    }

    /// A JSON string, decoded.
    fn string(&mut self) -> Result<String, Match<String>> {
        if let Some(m) = self.literal("\"") {
            return Err(m);
        }
        let start = self.at - 1;
        let mut escaped = false;
        for (i, c) in self.text[self.at..].char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => {
                    let end = self.at + i + 1;
                    self.at = end;
                    return serde_json::from_str(&self.text[start..end]).map_err(|_| Match::No);
                }
                c if (c as u32) < 0x20 => return Err(Match::No),
                _ => {}
            }
        }
        Err(Match::Partial)
    }
}

/// `{"name": <string>, "arguments":` (any JSON whitespace) at the start of `text`.
fn head(text: &str) -> Match<String> {
    let mut c = Cursor { text, at: 0 };
    macro_rules! expect {
        ($lit:expr) => {
            c.ws();
            if let Some(m) = c.literal($lit) {
                return m;
            }
        };
    }
    expect!("{");
    expect!("\"name\"");
    expect!(":");
    c.ws();
    let name = match c.string() {
        Ok(name) => name,
        Err(m) => return m,
    };
    expect!(",");
    expect!("\"arguments\"");
    expect!(":");
    Match::Yes(c.at, name)
}

/// `}` and, `tagged`, `</tool_call>` (any whitespace) at the start of `text`.
fn tail(text: &str, tagged: bool) -> Match<()> {
    let mut c = Cursor { text, at: 0 };
    let closing: &[&str] = if tagged { &["}", CLOSE] } else { &["}"] };
    for lit in closing {
        c.ws();
        if let Some(m) = c.literal(lit) {
            return m;
        }
    }
    Match::Yes(c.at, ())
}

/// Turns one output's text, piece by piece, into content and tool calls.
#[derive(Debug)]
pub struct ToolCallParser {
    state: State,
    /// Text not yet looked at.
    pending: String,
    /// Calls started so far.
    calls: usize,
    /// After a call: whitespace held until something other than a call follows it.
    held: String,
    events: Vec<ToolEvent>,
}

impl Default for ToolCallParser {
    fn default() -> Self {
        Self::new()
    }
}

impl ToolCallParser {
    pub fn new() -> Self {
        Self {
            state: State::Start(String::new()),
            pending: String::new(),
            calls: 0,
            held: String::new(),
            events: Vec::new(),
        }
    }

    /// Whether the output has made a call so far.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// What `text`, the output's next piece, adds.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.pending.push_str(text);
        self.run(false);
        std::mem::take(&mut self.events)
    }

    /// The output has ended: what was held back.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        self.run(true);
        std::mem::take(&mut self.events)
    }

    /// Parses a whole output at once.
    pub fn parse_all(text: &str) -> Vec<ToolEvent> {
        let mut parser = Self::new();
        let mut events = parser.push(text);
        events.extend(parser.finish());
        events
    }

    fn content(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        if self.calls > 0 {
            self.held.push_str(text);
            if self.held.trim().is_empty() {
                return;
            }
            let held = std::mem::take(&mut self.held);
            self.emit(ToolEvent::Content(held));
        } else {
            self.emit(ToolEvent::Content(text.to_owned()));
        }
    }

    /// Adds an event, merging it into the last one when both continue the same thing.
    fn emit(&mut self, event: ToolEvent) {
        match (self.events.last_mut(), event) {
            (Some(ToolEvent::Content(last)), ToolEvent::Content(more)) => last.push_str(&more),
            (
                Some(ToolEvent::Arguments { index, text }),
                ToolEvent::Arguments {
                    index: more_index,
                    text: more,
                },
            ) if *index == more_index => text.push_str(&more),
            (_, event) => self.events.push(event),
        }
    }

    /// Consumes as much of `pending` as can be decided; `at_end`: nothing more will come.
    // Long: one arm per parser state, each deciding how far the text it holds can go; the
    // transitions read best side by side, and splitting them would pass the whole state around.
    fn run(&mut self, at_end: bool) {
        loop {
            match std::mem::replace(&mut self.state, State::Text) {
                State::Start(mut lead) => {
                    let rest = self.pending.trim_start_matches([' ', '\t', '\n', '\r']);
                    let ws = self.pending.len() - rest.len();
                    lead.extend(self.pending.drain(..ws));
                    if self.pending.starts_with('{') {
                        self.state = State::Head {
                            buf: String::new(),
                            tagged: false,
                            lead,
                        };
                    } else if self.pending.is_empty() && !at_end {
                        self.state = State::Start(lead);
                        return;
                    } else {
                        self.content(&lead);
                    }
                }
                State::Text => {
                    if let Some(at) = self.pending.find(OPEN) {
                        let before: String = self.pending.drain(..at + OPEN.len()).collect();
                        self.content(&before[..at]);
                        // Whitespace between calls is dropped.
                        self.held.clear();
                        self.state = State::Head {
                            buf: String::new(),
                            tagged: true,
                            lead: String::new(),
                        };
                        continue;
                    }
                    let keep = if at_end {
                        0
                    } else {
                        partial_tag_len(&self.pending, OPEN)
                    };
                    let emit: String = self.pending.drain(..self.pending.len() - keep).collect();
                    self.content(&emit);
                    return;
                }
                State::Head {
                    mut buf,
                    tagged,
                    lead,
                } => {
                    buf.push_str(&std::mem::take(&mut self.pending));
                    // What the head was, if it is no call.
                    let opening = if tagged { OPEN } else { lead.as_str() };
                    match head(&buf) {
                        Match::Yes(end, name) => {
                            self.pending = buf.split_off(end);
                            self.held.clear();
                            self.emit(ToolEvent::CallStart {
                                index: self.calls,
                                name,
                            });
                            self.calls += 1;
                            self.state = State::Arguments {
                                json: JsonPrefix::new(),
                                started: false,
                                tagged,
                            };
                        }
                        Match::No => {
                            // Not a call: its opening is content, and the rest is read again
                            // as text.
                            self.content(opening);
                            self.pending = buf;
                        }
                        Match::Partial if at_end => {
                            self.content(&format!("{opening}{buf}"));
                            return;
                        }
                        Match::Partial => {
                            self.state = State::Head { buf, tagged, lead };
                            return;
                        }
                    }
                }
                State::Arguments {
                    mut json,
                    started,
                    tagged,
                } => {
                    let index = self.calls - 1;
                    let (used, next) = arguments(&mut json, started, &self.pending);
                    let text: String = self.pending.drain(..used).collect();
                    let text = if started {
                        &text[..]
                    } else {
                        text.trim_start()
                    };
                    if !text.is_empty() {
                        self.emit(ToolEvent::Arguments {
                            index,
                            text: text.to_owned(),
                        });
                    }
                    match next {
                        ArgumentsEnd::Open if at_end => return,
                        ArgumentsEnd::Open => {
                            let started = started || !text.is_empty();
                            self.state = State::Arguments {
                                json,
                                started,
                                tagged,
                            };
                            return;
                        }
                        ArgumentsEnd::Ended => {
                            self.state = State::Tail {
                                buf: String::new(),
                                tagged,
                            }
                        }
                        // The call ends with what it has; the rest is text.
                        ArgumentsEnd::Broken => {}
                    }
                }
                State::Tail { mut buf, tagged } => {
                    buf.push_str(&std::mem::take(&mut self.pending));
                    match tail(&buf, tagged) {
                        Match::Yes(end, ()) => {
                            self.pending = buf.split_off(end);
                            self.state = State::Start(String::new());
                        }
                        Match::No => self.pending = buf,
                        // Cut inside the closing tag: the call is whole, the rest is syntax.
                        Match::Partial if at_end => return,
                        Match::Partial => {
                            self.state = State::Tail { buf, tagged };
                            return;
                        }
                    }
                }
            }
        }
    }
}

enum ArgumentsEnd {
    /// All of the text belongs to the arguments, which go on.
    Open,
    Ended,
    /// The JSON broke at the first unused byte.
    Broken,
}

/// Feeds `text` to the arguments' checker: how many bytes belong to them, and why it stopped.
fn arguments(json: &mut JsonPrefix, started: bool, text: &str) -> (usize, ArgumentsEnd) {
    let mut started = started;
    for (i, c) in text.char_indices() {
        if !started && matches!(c, ' ' | '\t' | '\n' | '\r') {
            continue;
        }
        started = true;
        match json.feed(c) {
            Feed::More => {}
            Feed::Ended => return (i + c.len_utf8(), ArgumentsEnd::Ended),
            Feed::EndedBefore => return (i, ArgumentsEnd::Ended),
            Feed::Invalid => return (i, ArgumentsEnd::Broken),
        }
    }
    (text.len(), ArgumentsEnd::Open)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An output's content and calls `(name, arguments)`, folded from events; checks that
    /// each call's arguments come after its start.
    fn fold(events: &[ToolEvent]) -> (String, Vec<(String, String)>) {
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for e in events {
            match e {
                ToolEvent::Content(t) => content.push_str(t),
                ToolEvent::CallStart { index, name } => {
                    assert_eq!(*index, calls.len(), "{events:?}");
                    calls.push((name.clone(), String::new()));
                }
                ToolEvent::Arguments { index, text } => {
                    assert_eq!(*index + 1, calls.len(), "{events:?}");
                    calls[*index].1.push_str(text);
                }
            }
        }
        (content, calls)
    }

    fn streamed(pieces: &[&str]) -> Vec<ToolEvent> {
        let mut p = ToolCallParser::new();
        let mut events: Vec<ToolEvent> = pieces.iter().flat_map(|piece| p.push(piece)).collect();
        events.extend(p.finish());
        events
    }

    /// Every way of cutting `text` in two, and one character at a time, gives `expected`;
    /// with `no_leak`, no content event ever shows any part of a tag.
    fn check(text: &str, content: &str, calls: &[(&str, &str)], no_leak: bool) {
        let expected = (
            content.to_owned(),
            calls
                .iter()
                .map(|(n, a)| (n.to_string(), a.to_string()))
                .collect::<Vec<_>>(),
        );
        let whole = ToolCallParser::parse_all(text);
        assert_eq!(fold(&whole), expected, "whole: {text:?}");
        let mut cuts: Vec<Vec<&str>> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .map(|i| vec![&text[..i], &text[i..]])
            .collect();
        cuts.push(
            text.char_indices()
                .map(|(i, c)| &text[i..i + c.len_utf8()])
                .collect(),
        );
        for pieces in cuts {
            let events = streamed(&pieces);
            assert_eq!(fold(&events), expected, "pieces {pieces:?}");
            if no_leak {
                for e in &events {
                    if let ToolEvent::Content(t) = e {
                        assert!(!t.contains('<') && !t.contains('}'), "{t:?} in {pieces:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn text_then_a_call() {
        check(
            "Sure, let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>",
            "Sure, let me check.\n",
            &[("get_weather", "{\"city\": \"Paris\", \"days\": 2}")],
            true,
        );
    }

    #[test]
    fn two_parallel_calls() {
        check(
            "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>\n",
            "",
            &[("a", "{\"x\": 1}"), ("b", "{}")],
            true,
        );
    }

    #[test]
    fn nested_json_and_tags_inside_strings() {
        check(
            "<tool_call>\n{\"name\": \"r\\u00e9\", \"arguments\": {\"code\": \"print('</tool_call>')\", \"o\": {\"d\": [1, {\"k\": \"}\\\"<tool_call>\"}], \"é\": null}}}\n</tool_call>",
            "",
            &[("ré", "{\"code\": \"print('</tool_call>')\", \"o\": {\"d\": [1, {\"k\": \"}\\\"<tool_call>\"}], \"é\": null}}")],
            false,
        );
    }

    #[test]
    fn text_after_a_call_is_content() {
        check(
            "<tool_call>{\"name\":\"f\",\"arguments\":[true]}</tool_call>\n\nDone.",
            "\n\nDone.",
            &[("f", "[true]")],
            false,
        );
    }

    #[test]
    fn malformed_calls_are_content() {
        for text in [
            "<tool_call>\n{\"name\": 3}\n</tool_call> ok",
            "<tool_call>oops</tool_call>",
            "x <tool_call>\n{\"arguments\": {}, \"name\": \"f\"}\n</tool_call>",
            "<tool_call>\n{\"name\": \"a\\qb\", \"arguments\": {}}",
            "a < b <tool x",
        ] {
            check(text, text, &[], false);
        }
    }

    #[test]
    fn bare_calls_without_tags() {
        check(
            "{\"name\": \"f\", \"arguments\": {\"a\": \"}\"}}",
            "",
            &[("f", "{\"a\": \"}\"}")],
            true,
        );
        check(
            "\n{\"name\": \"f\", \"arguments\": {}}\n{\"name\": \"g\", \"arguments\": {\"x\": [1]}}\n",
            "",
            &[("f", "{}"), ("g", "{\"x\": [1]}")],
            true,
        );
        check(
            "{\"name\": \"f\", \"arguments\": 7}\nDone.",
            "\nDone.",
            &[("f", "7")],
            false,
        );
        // Only where a call may start, and only in the call's shape.
        for text in [
            "{\"a\": 1}",
            "  {\"name\": \"f\"}",
            "Sure: {\"name\": \"f\", \"arguments\": {}}",
            "{",
            " \n ",
        ] {
            check(text, text, &[], false);
        }
    }

    #[test]
    fn a_malformed_tag_before_a_call() {
        check(
            "<tool_call><tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
            "<tool_call>",
            &[("f", "{}")],
            false,
        );
    }

    #[test]
    fn unfinished_tags_are_flushed_as_content() {
        check("Hello <tool_", "Hello <tool_", &[], false);
        check(
            "<tool_call>\n{\"name\": \"f\"",
            "<tool_call>\n{\"name\": \"f\"",
            &[],
            false,
        );
    }

    #[test]
    fn a_call_cut_short_keeps_its_arguments() {
        check(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"b",
            "",
            &[("f", "{\"a\": \"b")],
            true,
        );
        check(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_",
            "",
            &[("f", "{}")],
            true,
        );
    }

    #[test]
    fn arguments_that_break_end_the_call() {
        check(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\" 1}}\n</tool_call>",
            "1}}\n</tool_call>",
            &[("f", "{\"a\" ")],
            false,
        );
    }
}
