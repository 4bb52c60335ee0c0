//! Incremental detokenization: token ids in, text deltas out.
//!
//! ```text
//!   ids:  ... | already emitted, no longer decoded | prefix_offset .. read_offset | new ids
//!                                                   \_ decoded again as context _/
//! ```
//! Each step decodes `ids[prefix_offset..read_offset]` (text already emitted) and
//! `ids[prefix_offset..]`; the difference is the delta. The window keeps a little context because
//! some decoders render a token differently depending on its neighbour.
//! Invariants: a delta is emitted only when the window's text does not end in U+FFFD, so a
//! character whose bytes are spread over several tokens comes out whole, once complete;
//! emitted windows end on a character boundary, so the concatenation of all deltas plus
//! `finish()` equals `decode(all_ids)` for byte-level tokenizers.

use std::sync::Arc;

use novainfer_core::TextOptions;

use crate::tokenizer::{Tokenizer, TokenizerError};

const REPLACEMENT: char = '\u{FFFD}';

#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    tokenizer: Arc<Tokenizer>,
    options: TextOptions,
    token_ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDetokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool) -> IncrementalDetokenizer {
        Self::with_options(
            tokenizer,
            TextOptions {
                skip_special_tokens,
                spaces_between_special_tokens: false,
            },
        )
    }

    pub fn with_options(tokenizer: Arc<Tokenizer>, options: TextOptions) -> IncrementalDetokenizer {
        IncrementalDetokenizer {
            tokenizer,
            options,
            token_ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Feeds one generated token; returns the text it completes, if any.
    pub fn step(&mut self, token_id: u32) -> Result<Option<String>, TokenizerError> {
        self.token_ids.push(token_id);
        let (emitted, window) = self.decode_window()?;
        if window.len() <= emitted.len() || window.ends_with(REPLACEMENT) {
            return Ok(None);
        }
        self.prefix_offset = self.read_offset;
        self.read_offset = self.token_ids.len();
        Ok(Some(text_after(&window, &emitted)))
    }

    /// Text still held back at the end of the stream: an incomplete trailing character, which
    /// decodes to U+FFFD exactly as the full decode would.
    pub fn finish(&mut self) -> Result<String, TokenizerError> {
        let (emitted, window) = self.decode_window()?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.token_ids.len();
        Ok(text_after(&window, &emitted))
    }

    pub fn token_ids(&self) -> &[u32] {
        &self.token_ids
    }

    /// (text of `[prefix_offset..read_offset]`, text of `[prefix_offset..]`).
    fn decode_window(&self) -> Result<(String, String), TokenizerError> {
        let emitted = decode(
            &self.tokenizer,
            &self.token_ids[self.prefix_offset..self.read_offset],
            self.options,
        )?;
        let window = decode(
            &self.tokenizer,
            &self.token_ids[self.prefix_offset..],
            self.options,
        )?;
        Ok((emitted, window))
    }
}

/// Text of `ids` under `options`. Kept special tokens with `spaces_between_special_tokens` are
/// set apart by single spaces, as Hugging Face's slow tokenizers join their "sub-texts": runs
/// of ordinary tokens decoded together, each special token on its own. Joining is local to
/// each boundary, so a window's text still begins with the text of its own first tokens.
pub fn decode(
    tokenizer: &Tokenizer,
    ids: &[u32],
    options: TextOptions,
) -> Result<String, TokenizerError> {
    let skip = options.skip_special_tokens;
    if skip || !options.spaces_between_special_tokens {
        return tokenizer.decode(ids, skip);
    }
    let mut pieces: Vec<String> = Vec::new();
    let mut run_start = 0;
    for (i, &id) in ids.iter().enumerate() {
        if tokenizer.is_special(id) {
            if run_start < i {
                pieces.push(tokenizer.decode(&ids[run_start..i], false)?);
            }
            pieces.push(tokenizer.decode(&[id], false)?);
            run_start = i + 1;
        }
    }
    if run_start < ids.len() {
        pieces.push(tokenizer.decode(&ids[run_start..], false)?);
    }
    Ok(pieces.join(" "))
}

/// `window` minus its leading `emitted` text. Decoders that rewrite the start of a window can
/// break the prefix relation; then cut at the first char boundary past `emitted`'s length.
fn text_after(window: &str, emitted: &str) -> String {
    if let Some(rest) = window.strip_prefix(emitted) {
        return rest.to_owned();
    }
    let cut = (emitted.len()..=window.len())
        .find(|&i| window.is_char_boundary(i))
        .unwrap_or(window.len());
    window[cut..].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_tokenizer::real_model_tests::demo_tokenizer;
    use crate::gguf_tokenizer::test_support::tiny_byte_level_tokenizer;

    /// Feeds `ids` one by one; checks every delta is free of U+FFFD (when the full text is) and
    /// extends a prefix of the full decode; returns the deltas and the final flush.
    fn stream(tokenizer: Arc<Tokenizer>, ids: &[u32], skip: bool) -> (Vec<String>, String) {
        let full = tokenizer.decode(ids, skip).expect("decode");
        let mut detok = IncrementalDetokenizer::new(tokenizer, skip);
        let mut deltas = Vec::new();
        let mut so_far = String::new();
        for &id in ids {
            if let Some(delta) = detok.step(id).expect("step") {
                assert!(
                    full.contains(REPLACEMENT) || !delta.contains(REPLACEMENT),
                    "{delta:?}"
                );
                so_far.push_str(&delta);
                assert!(
                    full.starts_with(&so_far),
                    "{so_far:?} is not a prefix of {full:?}"
                );
                deltas.push(delta);
            }
        }
        let rest = detok.finish().expect("finish");
        so_far.push_str(&rest);
        assert_eq!(so_far, full);
        (deltas, rest)
    }

    #[test]
    fn byte_tokens_come_out_as_whole_characters() {
        let tokenizer = Arc::new(tiny_byte_level_tokenizer());
        let text = "héllo 你好 🤖!";
        let ids = tokenizer.encode(text, false).expect("encode");
        assert_eq!(ids.len(), text.len(), "one token per byte");
        let (deltas, rest) = stream(tokenizer, &ids, false);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        assert_eq!(deltas, chars);
        assert_eq!(rest, "");
    }

    #[test]
    fn special_tokens_are_skipped_when_asked() {
        let tokenizer = Arc::new(tiny_byte_level_tokenizer());
        let ids = tokenizer
            .encode("<|im_start|>ok<tool_call><|im_end|>", false)
            .expect("encode");
        let (deltas, _) = stream(Arc::clone(&tokenizer), &ids, true);
        assert_eq!(deltas.concat(), "ok<tool_call>");
        let (deltas, _) = stream(tokenizer, &ids, false);
        assert_eq!(deltas.concat(), "<|im_start|>ok<tool_call><|im_end|>");
    }

    #[test]
    fn spaces_between_special_tokens_when_they_are_kept() {
        let tokenizer = Arc::new(tiny_byte_level_tokenizer());
        let ids = tokenizer
            .encode("<|im_start|>ok<|im_end|><|im_end|>x", false)
            .expect("encode");
        let spaced = TextOptions {
            skip_special_tokens: false,
            spaces_between_special_tokens: true,
        };
        let want = "<|im_start|> ok <|im_end|> <|im_end|> x";
        assert_eq!(decode(&tokenizer, &ids, spaced).expect("decode"), want);
        let mut detok = IncrementalDetokenizer::with_options(Arc::clone(&tokenizer), spaced);
        let mut text = String::new();
        for &id in &ids {
            text.push_str(&detok.step(id).expect("step").unwrap_or_default());
        }
        text.push_str(&detok.finish().expect("finish"));
        assert_eq!(text, want, "streamed text equals the whole decode");
        let skipped = TextOptions::default();
        assert_eq!(decode(&tokenizer, &ids, skipped).expect("decode"), "okx");
    }

    #[test]
    fn invalid_and_unfinished_bytes_match_the_full_decode() {
        let tokenizer = Arc::new(tiny_byte_level_tokenizer());
        // A lead byte followed by ASCII: the replacement char is real, emitted with the 'A'.
        let (deltas, rest) = stream(Arc::clone(&tokenizer), &[0xE4, 0x41], false);
        assert_eq!(
            (deltas, rest),
            (vec!["\u{FFFD}A".to_owned()], String::new())
        );
        // The stream ends inside a character: held back until finish().
        let (deltas, rest) = stream(tokenizer, &[0x41, 0xF0, 0x9F], false);
        assert_eq!(
            (deltas, rest),
            (vec!["A".to_owned()], "\u{FFFD}".to_owned())
        );
    }

    #[test]
    fn real_vocab_streams_chinese_and_emoji() {
        let Some(tokenizer) = demo_tokenizer() else {
            return;
        };
        let tokenizer = Arc::new(tokenizer);
        let text = "<|im_start|>assistant\n你好，世界！🤖🚀👩‍💻 naïve café\n```rust\nfn main() {}\n```<|im_end|>";
        let ids = tokenizer.encode(text, false).expect("encode");
        let (deltas, rest) = stream(Arc::clone(&tokenizer), &ids, true);
        assert_eq!(
            deltas.concat() + &rest,
            tokenizer.decode(&ids, true).expect("decode")
        );
        assert!(!deltas.concat().contains("<|im_end|>"));
        let (deltas, rest) = stream(tokenizer, &ids, false);
        assert_eq!(deltas.concat() + &rest, text);
    }
}
