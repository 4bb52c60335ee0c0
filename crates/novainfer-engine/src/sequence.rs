//! One sequence's output side: turns sampled tokens into text deltas.
//!
//! The scheduler decides stops by token id (EOS unless `ignore_eos`, stop token
//! ids) and by length, because it must free the sequence's blocks; this type
//! handles what needs text: incremental detokenization and stop strings. It lives
//! on the output thread; a stop string found here is reported in the delta, and
//! the output thread tells the engine (see `output_processor`).
//! As in vLLM, a stop token's own text is never shown, and text held back for a
//! possible stop string is released when the sequence ends for another reason.

use std::sync::Arc;

use novainfer_core::{FinishReason, SamplingParams};
use novainfer_model::sampler::SampledToken;

use crate::detokenizer::IncrementalDetokenizer;
use crate::error::Result;
use crate::request::{Delta, StopReason, TokenLogprob};
use crate::stop::StopStringMatcher;
use crate::tokenizer::Tokenizer;

pub struct SequenceOutput {
    detokenizer: IncrementalDetokenizer,
    stop_strings: StopStringMatcher,
    wants_logprobs: bool,
    /// The request's own stop token ids: a stop on one of them is reported as `stop_reason`.
    stop_token_ids: Vec<u32>,
    /// `include_stop_str_in_output`: a stop token's text stays in the output too.
    include_stop: bool,
    /// Text of the first `min_tokens` tokens is not searched for stop strings (as in vLLM).
    min_tokens: usize,
    num_tokens: usize,
}

impl SequenceOutput {
    pub fn new(tokenizer: Arc<Tokenizer>, params: &SamplingParams) -> Self {
        let stop = params.stop();
        Self {
            detokenizer: IncrementalDetokenizer::with_options(tokenizer, params.text_options()),
            stop_strings: StopStringMatcher::new(&stop.stop)
                .including_stop(stop.include_stop_str_in_output),
            wants_logprobs: params.logprobs().is_some(),
            stop_token_ids: stop.stop_token_ids.clone(),
            include_stop: stop.include_stop_str_in_output,
            min_tokens: params.min_tokens(),
            num_tokens: 0,
        }
    }

    /// Accounts for one sampled token. `finish` is the scheduler's verdict on it
    /// (`Stop` for a stop/EOS token id, `Length` for a length limit); the returned
    /// delta's `finish_reason` also covers a stop string found in its text.
    pub fn push(&mut self, sampled: SampledToken, finish: Option<FinishReason>) -> Result<Delta> {
        self.push_token(sampled, finish, finish == Some(FinishReason::Stop))
    }

    /// The last token of an output whose constraint is now complete: unlike a stop token its
    /// text is output, and the sequence ends with `stop`.
    pub fn push_completing(&mut self, sampled: SampledToken) -> Result<Delta> {
        self.push_token(sampled, Some(FinishReason::Stop), false)
    }

    /// `hidden`: the token is a stop/EOS token, whose text is never output.
    fn push_token(
        &mut self,
        sampled: SampledToken,
        finish: Option<FinishReason>,
        hidden: bool,
    ) -> Result<Delta> {
        let token = sampled.token_id;
        self.num_tokens += 1;
        let mut delta = Delta {
            token_ids: vec![token],
            ..Delta::default()
        };
        if self.wants_logprobs {
            delta.logprobs.push(TokenLogprob {
                token_id: token,
                logprob: sampled.logprob,
                top: sampled.top_logprobs,
                rank: sampled.rank,
            });
        }
        if hidden {
            delta.text = self.stop_strings.flush();
            if self.include_stop {
                if let Some(text) = self.detokenizer.step(token)? {
                    delta.text.push_str(&text);
                }
                delta.text.push_str(&self.detokenizer.finish()?);
            }
            delta.finish_reason = finish;
            delta.stop_reason = self
                .stop_token_ids
                .contains(&token)
                .then_some(StopReason::TokenId(token));
            return Ok(delta);
        }
        if let Some(text) = self.detokenizer.step(token)? {
            if self.num_tokens <= self.min_tokens {
                delta.text = text;
            } else {
                let out = self.stop_strings.push(&text);
                delta.text = out.emit;
                if out.stopped {
                    delta.finish_reason = Some(FinishReason::Stop);
                    delta.stop_reason = self.matched_stop();
                    return Ok(delta);
                }
            }
        }
        if let Some(reason) = finish {
            delta.text.push_str(&self.finish_text()?);
            if self.stop_strings.is_stopped() {
                delta.finish_reason = Some(FinishReason::Stop);
                delta.stop_reason = self.matched_stop();
            } else {
                delta.finish_reason = Some(reason);
            }
        }
        Ok(delta)
    }

    fn matched_stop(&self) -> Option<StopReason> {
        self.stop_strings
            .matched_stop()
            .map(|s| StopReason::Text(s.to_owned()))
    }

    /// Releases what is held back when the sequence ends without a stop string:
    /// an incomplete UTF-8 tail and text that might have begun a stop string.
    fn finish_text(&mut self) -> Result<String> {
        let tail = self.detokenizer.finish()?;
        if self.num_tokens <= self.min_tokens {
            return Ok(tail);
        }
        let out = self.stop_strings.push(&tail);
        let mut text = out.emit;
        if !out.stopped {
            text.push_str(&self.stop_strings.flush());
        }
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_tokenizer::test_support::tiny_byte_level_tokenizer;
    use novainfer_core::FinishReason;

    const EOS: u32 = 258;

    fn token(id: u32) -> SampledToken {
        SampledToken {
            token_id: id,
            logprob: -0.5,
            top_logprobs: vec![],
            rank: 0,
        }
    }

    /// Feeds `ids` until a delta finishes; returns the text, the tokens taken and the reason.
    /// Feeds `ids` until a delta finishes, with the scheduler's verdicts for an EOS-stopping,
    /// `max_new`-limited request; returns the text, the tokens taken and the reason.
    fn run(
        params: &SamplingParams,
        ids: &[u32],
        max_new: usize,
    ) -> (String, usize, Option<FinishReason>) {
        let mut seq = SequenceOutput::new(Arc::new(tiny_byte_level_tokenizer()), params);
        let mut text = String::new();
        for (i, &id) in ids.iter().enumerate() {
            let verdict = if id == EOS && !params.stop().ignore_eos {
                Some(FinishReason::Stop)
            } else if i + 1 == max_new {
                Some(FinishReason::Length)
            } else {
                None
            };
            let delta = seq.push(token(id), verdict).expect("push");
            text.push_str(&delta.text);
            if delta.finish_reason.is_some() {
                return (text, i + 1, delta.finish_reason);
            }
        }
        (text, ids.len(), None)
    }

    #[test]
    fn a_stop_token_adds_no_text_and_ignore_eos_reads_on() {
        let ids = [b'h' as u32, b'i' as u32, EOS, b'!' as u32];
        assert_eq!(
            run(&SamplingParams::greedy(), &ids, 10),
            ("hi".into(), 3, Some(FinishReason::Stop))
        );
        let ignore = SamplingParams::builder()
            .ignore_eos(true)
            .build()
            .expect("valid");
        let (text, taken, reason) = run(&ignore, &ids, 4);
        assert_eq!((taken, reason), (4, Some(FinishReason::Length)));
        assert!(text.starts_with("hi") && text.ends_with('!'), "{text:?}");
    }

    #[test]
    fn stop_string_held_back_is_released_at_the_length_limit() {
        let params = SamplingParams::builder()
            .stop(vec!["i!".into()])
            .build()
            .expect("valid");
        // "hi" ends with a possible start of "i!": held back, then released when max_new is reached.
        assert_eq!(
            run(&params, &[b'h' as u32, b'i' as u32], 2),
            ("hi".into(), 2, Some(FinishReason::Length))
        );
        assert_eq!(
            run(&params, &[b'h' as u32, b'i' as u32, b'!' as u32], 5),
            ("h".into(), 3, Some(FinishReason::Stop))
        );
    }

    /// Like [`run`], but returns the final delta's stop reason too.
    fn stop_reason_of(params: &SamplingParams, ids: &[u32]) -> (String, Option<StopReason>) {
        let mut seq = SequenceOutput::new(Arc::new(tiny_byte_level_tokenizer()), params);
        let mut text = String::new();
        for &id in ids {
            let verdict = (id == EOS || params.stop().stop_token_ids.contains(&id))
                .then_some(FinishReason::Stop);
            let delta = seq.push(token(id), verdict).expect("push");
            text.push_str(&delta.text);
            if delta.finish_reason.is_some() {
                return (text, delta.stop_reason);
            }
        }
        (text, None)
    }

    #[test]
    fn stop_reason_names_the_stop_string_or_token_and_include_keeps_it() {
        let b = |include: bool| {
            SamplingParams::builder()
                .stop(vec!["c!".into()])
                .stop_token_ids(vec![b'#' as u32])
                .include_stop_str_in_output(include)
                .build()
                .expect("valid")
        };
        let ids = |s: &str| s.bytes().map(u32::from).collect::<Vec<_>>();
        assert_eq!(
            stop_reason_of(&b(false), &ids("abc!d")),
            ("ab".into(), Some(StopReason::Text("c!".into())))
        );
        assert_eq!(
            stop_reason_of(&b(true), &ids("abc!d")),
            ("abc!".into(), Some(StopReason::Text("c!".into())))
        );
        assert_eq!(
            stop_reason_of(&b(false), &ids("ab#d")),
            ("ab".into(), Some(StopReason::TokenId(b'#' as u32)))
        );
        assert_eq!(
            stop_reason_of(&b(true), &ids("ab#d")),
            ("ab#".into(), Some(StopReason::TokenId(b'#' as u32)))
        );
        let mut eos = ids("ab");
        eos.push(EOS);
        assert_eq!(
            stop_reason_of(&b(false), &eos),
            ("ab".into(), None),
            "EOS has none"
        );
    }

    #[test]
    fn stop_strings_count_only_after_min_tokens() {
        let params = SamplingParams::builder()
            .stop(vec!["b".into()])
            .min_tokens(2)
            .build()
            .expect("valid");
        let ids: Vec<u32> = "abcbd".bytes().map(u32::from).collect();
        assert_eq!(
            stop_reason_of(&params, &ids),
            ("abc".into(), Some(StopReason::Text("b".into())))
        );
    }

    #[test]
    fn a_token_completing_a_constraint_is_text_and_releases_what_was_held_back() {
        let params = SamplingParams::builder()
            .stop(vec!["}x".into()])
            .build()
            .expect("valid");
        let mut seq = SequenceOutput::new(Arc::new(tiny_byte_level_tokenizer()), &params);
        let first = seq.push(token(b'{' as u32), None).expect("push");
        assert_eq!(first.text, "{");
        // "}" could begin the stop string "}x", yet the output ends here: it is released.
        let last = seq.push_completing(token(b'}' as u32)).expect("push");
        assert_eq!(last.text, "}");
        assert_eq!(last.finish_reason, Some(FinishReason::Stop));
    }

    #[test]
    fn a_split_utf8_character_is_completed_at_the_length_limit() {
        // "é" is two byte tokens; a limit after the first must not emit half a character.
        let (text, _, reason) = run(&SamplingParams::greedy(), &[0xC3], 1);
        assert_eq!(reason, Some(FinishReason::Length));
        assert!(!text.contains('é'));
        let (text, _, _) = run(&SamplingParams::greedy(), &[0xC3, 0xA9], 2);
        assert_eq!(text, "é");
    }
}
