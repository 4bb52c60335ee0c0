//! Splitting a reasoning model's output (DeepSeek-R1 style) into `reasoning_content`, the text
//! before `</think>`, and `content`, the text after it.
//!
//! The chat template may already have opened `<think>` (R1-distill templates end the prompt
//! with `<think>\n`); otherwise reasoning starts only if the output itself begins with
//! `<think>`, and an output that does not is all content. Deltas arrive in arbitrary pieces,
//! so a tag split across deltas is held back until it is complete, and no tag text ever
//! reaches either field. If `</think>` never comes, everything after `<think>` is reasoning.

use clap::ValueEnum;

/// `--reasoning-parser`: whether a model's output is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReasoningParser {
    /// On when the tokenizer knows a `</think>` token.
    Auto,
    /// DeepSeek-R1 style `<think>...</think>`.
    #[value(name = "deepseek_r1", alias = "deepseek-r1")]
    DeepseekR1,
    /// Reasoning stays in the answer's text.
    None,
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not yet known whether the output opens with `<think>`.
    Undecided,
    Reasoning,
    /// After `</think>`: leading newlines are still dropped.
    ContentStart,
    Content,
}

/// What one delta contributes to each field.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    state: State,
    pending: String,
}

/// Whether the rendered prompt leaves the model inside a `<think>` block.
pub fn prompt_opens_thinking(prompt: &str) -> bool {
    prompt.trim_end().ends_with(OPEN)
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`.
pub(crate) fn partial_tag_len(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| {
            text.len() >= n
                && text.is_char_boundary(text.len() - n)
                && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

impl ReasoningSplitter {
    pub fn new(opened_by_prompt: bool) -> Self {
        Self {
            state: if opened_by_prompt {
                State::Reasoning
            } else {
                State::Undecided
            },
            pending: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> Split {
        self.pending.push_str(text);
        let mut out = Split::default();
        loop {
            match self.state {
                State::Undecided => {
                    let trimmed = self.pending.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(OPEN) {
                        self.pending = rest.to_owned();
                        self.state = State::Reasoning;
                    } else if !trimmed.is_empty() && !OPEN.starts_with(trimmed) {
                        self.state = State::Content;
                    } else {
                        return out;
                    }
                }
                State::Reasoning => match self.pending.find(CLOSE) {
                    Some(at) => {
                        out.reasoning.push_str(&self.pending[..at]);
                        self.pending.drain(..at + CLOSE.len());
                        self.state = State::ContentStart;
                    }
                    None => {
                        let keep = partial_tag_len(&self.pending, CLOSE);
                        let emit = self.pending.len() - keep;
                        out.reasoning.push_str(&self.pending[..emit]);
                        self.pending.drain(..emit);
                        return out;
                    }
                },
                State::ContentStart => {
                    let rest = self.pending.trim_start_matches(['\n', '\r']);
                    if rest.is_empty() {
                        self.pending.clear();
                        return out;
                    }
                    self.pending = rest.to_owned();
                    self.state = State::Content;
                }
                State::Content => {
                    out.content.push_str(&self.pending);
                    self.pending.clear();
                    return out;
                }
            }
        }
    }

    /// Flushes what was held back once the output has ended.
    pub fn finish(&mut self) -> Split {
        let pending = std::mem::take(&mut self.pending);
        match self.state {
            State::Reasoning => Split {
                reasoning: pending,
                content: String::new(),
            },
            State::ContentStart => Split::default(),
            State::Undecided | State::Content => Split {
                reasoning: String::new(),
                content: pending,
            },
        }
    }

    /// Splits a whole output at once.
    pub fn split_all(opened_by_prompt: bool, text: &str) -> Split {
        let mut s = Self::new(opened_by_prompt);
        let mut out = s.push(text);
        let tail = s.finish();
        out.reasoning.push_str(&tail.reasoning);
        out.content.push_str(&tail.content);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(opened: bool, pieces: &[&str]) -> Split {
        let mut s = ReasoningSplitter::new(opened);
        let mut all = Split::default();
        for p in pieces {
            let d = s.push(p);
            assert!(
                !d.reasoning.contains('<') || !d.reasoning.contains("think>"),
                "{d:?}"
            );
            all.reasoning.push_str(&d.reasoning);
            all.content.push_str(&d.content);
        }
        let d = s.finish();
        all.reasoning.push_str(&d.reasoning);
        all.content.push_str(&d.content);
        all
    }

    fn split(r: &str, c: &str) -> Split {
        Split {
            reasoning: r.into(),
            content: c.into(),
        }
    }

    #[test]
    fn template_opened_think() {
        assert_eq!(
            streamed(true, &["Let me", " think.</think>\n\nParis"]),
            split("Let me think.", "Paris")
        );
        // The tag split across deltas, one character at a time.
        let text = "abc</think>\n\nxyz";
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(streamed(true, &pieces), split("abc", "xyz"));
        assert_eq!(
            ReasoningSplitter::split_all(true, text),
            split("abc", "xyz")
        );
    }

    #[test]
    fn output_opens_think_itself() {
        assert_eq!(
            streamed(false, &["<thi", "nk>\nhm</th", "ink>ok"]),
            split("\nhm", "ok")
        );
        assert_eq!(streamed(false, &["\n<think>a</think>b"]), split("a", "b"));
    }

    #[test]
    fn no_think_is_all_content() {
        assert_eq!(streamed(false, &["Paris", " is"]), split("", "Paris is"));
        // A lone `<` is held only until it cannot start `<think>`.
        assert_eq!(streamed(false, &["<", "b>"]), split("", "<b>"));
        assert_eq!(streamed(false, &["<thi"]), split("", "<thi"));
    }

    #[test]
    fn unterminated_thinking_is_all_reasoning() {
        assert_eq!(
            streamed(true, &["still thinking </thi"]),
            split("still thinking </thi", "")
        );
    }

    #[test]
    fn multibyte_text_near_a_partial_tag() {
        assert_eq!(streamed(true, &["é</", "think>ü"]), split("é", "ü"));
        assert_eq!(partial_tag_len("é<", CLOSE), 1);
        assert_eq!(partial_tag_len("é", CLOSE), 0);
    }

    #[test]
    fn prompt_detection() {
        assert!(prompt_opens_thinking("<|Assistant|><think>\n"));
        assert!(!prompt_opens_thinking("<|im_start|>assistant\n"));
    }
}
