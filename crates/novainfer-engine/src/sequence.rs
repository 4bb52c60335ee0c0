//! One sequence's output side: turns sampled tokens into deltas and decides
//! when the sequence is finished.
//!
//! Order of checks for each token (as in vLLM): the token is appended; an EOS
//! (unless `ignore_eos`) or a stop token id finishes with `stop` and adds no
//! text; otherwise its text passes the detokenizer and the stop-string matcher,
//! which may finish with `stop`; finally the length limit finishes with `length`.

use std::collections::HashSet;
use std::sync::Arc;

use novainfer_core::{FinishReason, SamplingParams};
use novainfer_model::sampler::SampledToken;

use crate::detokenizer::IncrementalDetokenizer;
use crate::error::Result;
use crate::request::{Delta, TokenLogprob};
use crate::stop::StopStringMatcher;
use crate::tokenizer::Tokenizer;

pub struct SequenceOutput {
    detokenizer: IncrementalDetokenizer,
    stop_strings: StopStringMatcher,
    stop_token_ids: HashSet<u32>,
    wants_logprobs: bool,
    max_new_tokens: usize,
    num_generated: usize,
}

impl SequenceOutput {
    /// `eos_token_ids` are the model's; they are ignored with `ignore_eos`.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        params: &SamplingParams,
        eos_token_ids: &[u32],
        max_new_tokens: usize,
    ) -> Self {
        let stop = params.stop();
        let mut stop_token_ids: HashSet<u32> = stop.stop_token_ids.iter().copied().collect();
        if !stop.ignore_eos {
            stop_token_ids.extend(eos_token_ids);
        }
        Self {
            detokenizer: IncrementalDetokenizer::new(tokenizer, true),
            stop_strings: StopStringMatcher::new(&stop.stop),
            stop_token_ids,
            wants_logprobs: params.logprobs().is_some(),
            max_new_tokens,
            num_generated: 0,
        }
    }

    /// Accounts for one sampled token; the returned delta says whether the sequence is done.
    pub fn push(&mut self, sampled: SampledToken) -> Result<Delta> {
        let token = sampled.token_id;
        self.num_generated += 1;
        let mut delta = Delta {
            token_ids: vec![token],
            ..Delta::default()
        };
        if self.wants_logprobs {
            delta.logprobs.push(TokenLogprob {
                token_id: token,
                logprob: sampled.logprob,
                top: sampled.top_logprobs,
            });
        }
        if self.stop_token_ids.contains(&token) {
            delta.text = self.stop_strings.flush();
            delta.finish_reason = Some(FinishReason::Stop);
            return Ok(delta);
        }
        if let Some(text) = self.detokenizer.step(token)? {
            let out = self.stop_strings.push(&text);
            delta.text = out.emit;
            if out.stopped {
                delta.finish_reason = Some(FinishReason::Stop);
                return Ok(delta);
            }
        }
        if self.num_generated >= self.max_new_tokens {
            // Characters the detokenizer still holds (an incomplete UTF-8 tail) and
            // text held back for a possible stop string are released now.
            let tail = self.detokenizer.finish()?;
            let out = self.stop_strings.push(&tail);
            delta.text.push_str(&out.emit);
            if !out.stopped {
                delta.text.push_str(&self.stop_strings.flush());
            }
            delta.finish_reason = Some(if out.stopped {
                FinishReason::Stop
            } else {
                FinishReason::Length
            });
        }
        Ok(delta)
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
        }
    }

    /// Feeds `ids` until a delta finishes; returns the text, the tokens taken and the reason.
    fn run(
        params: &SamplingParams,
        ids: &[u32],
        max_new: usize,
    ) -> (String, usize, Option<FinishReason>) {
        let mut seq = SequenceOutput::new(
            Arc::new(tiny_byte_level_tokenizer()),
            params,
            &[EOS],
            max_new,
        );
        let mut text = String::new();
        for (i, &id) in ids.iter().enumerate() {
            let delta = seq.push(token(id)).expect("push");
            text.push_str(&delta.text);
            if delta.finish_reason.is_some() {
                return (text, i + 1, delta.finish_reason);
            }
        }
        (text, ids.len(), None)
    }

    #[test]
    fn eos_stops_without_text_unless_ignored() {
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
