//! Output transforms of chat completions: a choice's text, piece by piece as it streams (or
//! whole), becomes `reasoning_content` (a reasoning model's text before `</think>`), content,
//! and tool calls (the Hermes `<tool_call>` blocks of the content). Both transforms hold
//! back partial tags, so stream and whole answer say the same.

use crate::protocol::response::{FunctionCallOut, ToolCallOut};
use crate::reasoning::ReasoningSplitter;
use crate::tools::hermes::{ToolCallParser, ToolEvent};

/// What a piece of output adds to each field.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ChatPiece {
    pub reasoning: String,
    pub content: String,
    /// Tool calls started or continued.
    pub calls: Vec<ToolCallOut>,
}

impl ChatPiece {
    /// Appends `more`, the next piece of the same output.
    pub fn extend(&mut self, more: ChatPiece) {
        self.reasoning.push_str(&more.reasoning);
        self.content.push_str(&more.content);
        self.calls = merge_calls(
            std::mem::take(&mut self.calls)
                .into_iter()
                .chain(more.calls),
        );
    }
}

/// One choice's transforms.
#[derive(Debug)]
pub struct ChatTransform {
    reasoning: Option<ReasoningSplitter>,
    tools: Option<ToolCallParser>,
}

impl ChatTransform {
    /// `reasoning`: split reasoning off, `Some(true)` when the prompt opened `<think>`;
    /// `tools`: read the content for tool calls.
    pub fn new(reasoning: Option<bool>, tools: bool) -> Self {
        Self {
            reasoning: reasoning.map(ReasoningSplitter::new),
            tools: tools.then(ToolCallParser::new),
        }
    }

    /// Whether the output has called a tool so far.
    pub fn called(&self) -> bool {
        self.tools.as_ref().is_some_and(ToolCallParser::called)
    }

    /// One delta of the output: its text, and on the last delta what was held back.
    pub fn push_delta(&mut self, delta: &novainfer_engine::Delta) -> ChatPiece {
        let mut piece = self.push(&delta.text);
        if delta.finish_reason.is_some() {
            piece.extend(self.finish());
        }
        piece
    }

    pub fn push(&mut self, text: &str) -> ChatPiece {
        let (reasoning, content) = match &mut self.reasoning {
            Some(splitter) => {
                let split = splitter.push(text);
                (split.reasoning, split.content)
            }
            None => (String::new(), text.to_owned()),
        };
        self.content(reasoning, content, false)
    }

    /// The output has ended: what was held back.
    pub fn finish(&mut self) -> ChatPiece {
        let (reasoning, content) = match &mut self.reasoning {
            Some(splitter) => {
                let split = splitter.finish();
                (split.reasoning, split.content)
            }
            None => (String::new(), String::new()),
        };
        self.content(reasoning, content, true)
    }

    /// A whole output at once.
    pub fn all(mut self, text: &str) -> (ChatPiece, bool) {
        let mut piece = self.push(text);
        piece.extend(self.finish());
        (piece, self.called())
    }

    fn content(&mut self, reasoning: String, content: String, end: bool) -> ChatPiece {
        let Some(parser) = &mut self.tools else {
            return ChatPiece {
                reasoning,
                content,
                calls: Vec::new(),
            };
        };
        let mut events = parser.push(&content);
        if end {
            events.extend(parser.finish());
        }
        let mut piece = ChatPiece {
            reasoning,
            ..ChatPiece::default()
        };
        let mut calls = Vec::new();
        for event in events {
            match event {
                ToolEvent::Content(text) => piece.content.push_str(&text),
                ToolEvent::CallStart { index, name } => calls.push(ToolCallOut {
                    index: Some(index),
                    id: Some(call_id()),
                    kind: Some("function"),
                    function: FunctionCallOut {
                        name: Some(name),
                        arguments: Some(String::new()),
                    },
                }),
                ToolEvent::Arguments { index, text } => calls.push(ToolCallOut {
                    index: Some(index),
                    function: FunctionCallOut {
                        name: None,
                        arguments: Some(text),
                    },
                    ..ToolCallOut::default()
                }),
            }
        }
        piece.calls = merge_calls(calls);
        piece
    }
}

/// Merges each piece of a call into the one before it when both belong to the same call.
fn merge_calls(calls: impl IntoIterator<Item = ToolCallOut>) -> Vec<ToolCallOut> {
    let mut merged: Vec<ToolCallOut> = Vec::new();
    for call in calls {
        match merged.last_mut() {
            Some(last) if last.index == call.index && call.id.is_none() => {
                let more = call.function.arguments.unwrap_or_default();
                last.function
                    .arguments
                    .get_or_insert_with(String::new)
                    .push_str(&more);
            }
            _ => merged.push(call),
        }
    }
    merged
}

/// A fresh call id, in OpenAI's shape (`call_` and 24 characters).
fn call_id() -> String {
    format!(
        "call_{:016x}{:08x}",
        rand::random::<u64>(),
        rand::random::<u32>()
    )
}

/// A chat finish reason: `tool_calls` for an output that called tools and ended normally.
pub fn finish_reason(engine: &'static str, called: bool) -> &'static str {
    if called && engine == "stop" {
        "tool_calls"
    } else {
        engine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUTPUT: &str = "<think>\nweather?</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

    #[test]
    fn reasoning_then_content_then_calls() {
        let (piece, called) = ChatTransform::new(Some(false), true).all(OUTPUT);
        assert!(called);
        assert_eq!(piece.reasoning, "\nweather?");
        assert_eq!(piece.content, "Let me check.\n");
        assert_eq!(piece.calls.len(), 1);
        let call = &piece.calls[0];
        assert!(call
            .id
            .as_ref()
            .is_some_and(|id| id.starts_with("call_") && id.len() == 29));
        assert_eq!(call.function.name.as_deref(), Some("w"));
        assert_eq!(
            call.function.arguments.as_deref(),
            Some("{\"city\": \"Paris\"}")
        );
    }

    #[test]
    fn streamed_pieces_carry_the_name_first_then_arguments() {
        let mut t = ChatTransform::new(Some(false), true);
        let mut pieces: Vec<ChatPiece> = OUTPUT
            .char_indices()
            .map(|(i, c)| t.push(&OUTPUT[i..i + c.len_utf8()]))
            .collect();
        pieces.push(t.finish());
        let calls: Vec<&ToolCallOut> = pieces.iter().flat_map(|p| &p.calls).collect();
        assert_eq!(calls[0].function.name.as_deref(), Some("w"));
        assert_eq!(calls[0].function.arguments.as_deref(), Some(""));
        assert!(calls[1..]
            .iter()
            .all(|c| c.id.is_none() && c.function.name.is_none()));
        assert!(calls.iter().all(|c| c.index == Some(0)));
        let arguments: String = calls
            .iter()
            .filter_map(|c| c.function.arguments.as_deref())
            .collect();
        assert_eq!(arguments, "{\"city\": \"Paris\"}");
        let content: String = pieces.iter().map(|p| p.content.as_str()).collect();
        assert_eq!(content, "Let me check.\n");
    }

    #[test]
    fn without_tools_the_tags_are_content() {
        let (piece, called) = ChatTransform::new(None, false).all(OUTPUT);
        assert!(!called && piece.calls.is_empty());
        assert_eq!(piece.content, OUTPUT);
        assert_eq!(finish_reason("stop", called), "stop");
        assert_eq!(finish_reason("stop", true), "tool_calls");
        assert_eq!(finish_reason("length", true), "length");
    }
}
