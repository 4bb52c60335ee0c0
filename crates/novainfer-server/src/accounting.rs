//! Per-request bookkeeping shared by completions and chat: each choice's text, tokens,
//! logprobs and finish reason as deltas arrive, timing into the metrics histograms, usage,
//! and the conversion of engine logprobs into both OpenAI logprob shapes.

use std::time::Instant;

use novainfer_engine::tokenizer::Tokenizer;
use novainfer_engine::{Delta, Speculation, StopReason, TokenLogprob};
use serde_json::{Map, Value};

use crate::metrics::ModelMetrics;
use crate::protocol::response::{
    ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob, Usage,
};

#[derive(Debug, Default, Clone)]
pub struct ChoiceState {
    pub text: String,
    pub num_tokens: usize,
    pub finish_reason: Option<&'static str>,
    /// The stop string or stop token id that ended the choice.
    pub stop_reason: Option<StopReason>,
    pub logprobs: Vec<TokenLogprob>,
    last_token: Option<Instant>,
}

/// vLLM's `stop_reason`: the stop string, the stop token id, or null (EOS, length, abort).
pub fn stop_reason_json(reason: Option<&StopReason>) -> Value {
    match reason {
        None => Value::Null,
        Some(StopReason::TokenId(id)) => Value::from(*id),
        Some(StopReason::Text(s)) => Value::from(s.as_str()),
    }
}

/// Everything a request has produced so far.
pub struct RunState {
    pub arrival: Instant,
    first_token: Option<Instant>,
    /// When the engine first scheduled the request (the first prompt's, for several).
    scheduled_at: Option<Instant>,
    pub choices: Vec<ChoiceState>,
    n: usize,
    prompt_lens: Vec<usize>,
    cached: Vec<usize>,
    /// Drafts verified for all choices together.
    speculation: Speculation,
}

impl RunState {
    pub fn new(arrival: Instant, prompt_lens: Vec<usize>, n: usize) -> Self {
        Self {
            arrival,
            first_token: None,
            scheduled_at: None,
            choices: vec![ChoiceState::default(); prompt_lens.len() * n],
            n,
            cached: vec![0; prompt_lens.len()],
            prompt_lens,
            speculation: Speculation::default(),
        }
    }

    /// Folds in one delta of prompt `prompt`; returns the OpenAI choice index it belongs to.
    pub fn record(
        &mut self,
        prompt: usize,
        delta: &Delta,
        metrics: &ModelMetrics,
        now: Instant,
    ) -> usize {
        // Choices are numbered prompt-major, as OpenAI numbers them for a list of prompts.
        let index = prompt * self.n + delta.index.min(self.n - 1);
        self.cached[prompt] = self.cached[prompt].max(delta.num_cached_tokens);
        self.speculation += delta.speculation;
        let choice = &mut self.choices[index];
        let k = delta.token_ids.len();
        if k > 0 {
            if self.first_token.is_none() {
                self.first_token = Some(now);
                metrics
                    .ttft
                    .observe(now.duration_since(self.arrival).as_secs_f64());
                if let Some(at) = delta.scheduled_at {
                    self.scheduled_at = Some(at);
                    let queued = at.saturating_duration_since(self.arrival);
                    metrics.queue_time.observe(queued.as_secs_f64());
                    metrics
                        .prefill_time
                        .observe(now.saturating_duration_since(at).as_secs_f64());
                }
            }
            if let Some(last) = choice.last_token {
                let per_token = now.duration_since(last).as_secs_f64() / k as f64;
                for _ in 0..k {
                    metrics.itl.observe(per_token);
                }
            }
            choice.last_token = Some(now);
        }
        choice.text.push_str(&delta.text);
        choice.num_tokens += k;
        choice.logprobs.extend(delta.logprobs.iter().cloned());
        if let Some(reason) = delta.finish_reason {
            choice.finish_reason = Some(reason.as_str());
            choice.stop_reason = delta.stop_reason.clone();
        }
        index
    }

    /// From arrival (permit wait included) to the engine's first step for it.
    pub fn queue_time(&self) -> Option<std::time::Duration> {
        Some(self.scheduled_at?.saturating_duration_since(self.arrival))
    }

    /// From the engine's first step for it to its first token.
    pub fn prefill_time(&self) -> Option<std::time::Duration> {
        Some(
            self.first_token?
                .saturating_duration_since(self.scheduled_at?),
        )
    }

    pub fn usage(&self) -> Usage {
        Usage::new(
            self.prompt_lens.iter().sum(),
            self.choices.iter().map(|c| c.num_tokens).sum(),
            self.cached.iter().sum(),
        )
        .with_speculation(
            self.speculation.num_draft_tokens,
            self.speculation.num_accepted_tokens,
        )
    }

    /// The first choice's finish reason, `abort` if it never finished.
    pub fn finish_reason(&self) -> &'static str {
        self.choices
            .first()
            .and_then(|c| c.finish_reason)
            .unwrap_or("abort")
    }

    /// Choices that never got their last delta (cancelled while queued).
    pub fn unfinished(&self) -> impl Iterator<Item = usize> + '_ {
        self.choices
            .iter()
            .enumerate()
            .filter(|(_, c)| c.finish_reason.is_none())
            .map(|(index, _)| index)
    }

    pub fn all_finished(&self) -> bool {
        self.choices.iter().all(|c| c.finish_reason.is_some())
    }
}

/// A token's text as the client sees it (special tokens spelled out).
fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

/// Completions-style logprobs of `logprobs`, whose text starts at `offset` in the choice's text.
pub fn completion_logprobs(
    tokenizer: &Tokenizer,
    logprobs: &[TokenLogprob],
    offset: usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    extend_completion_logprobs(
        &mut out,
        tokenizer,
        logprobs.iter().map(|lp| (lp.token_id, Some(lp))),
        offset,
    );
    out
}

/// Appends `(token id, logprobs if known)` entries; text offsets continue from `offset`.
pub fn extend_completion_logprobs<'a>(
    out: &mut CompletionLogprobs,
    tokenizer: &Tokenizer,
    entries: impl IntoIterator<Item = (u32, Option<&'a TokenLogprob>)>,
    mut offset: usize,
) {
    for (token_id, lp) in entries {
        let token = token_text(tokenizer, token_id);
        out.text_offset.push(offset);
        offset += token.len();
        out.tokens.push(token);
        out.token_logprobs.push(lp.map(|lp| lp.logprob));
        out.top_logprobs.push(lp.map(|lp| {
            lp.top
                .iter()
                .map(|&(id, logprob)| (token_text(tokenizer, id), Value::from(logprob as f64)))
                .collect::<Map<String, Value>>()
        }));
    }
}

pub fn chat_logprobs(tokenizer: &Tokenizer, logprobs: &[TokenLogprob]) -> ChatLogprobs {
    let entry = |id: u32, logprob: f32| TopLogprob {
        bytes: tokenizer.token_bytes(id),
        token: token_text(tokenizer, id),
        logprob,
    };
    ChatLogprobs {
        content: logprobs
            .iter()
            .map(|lp| {
                let chosen = entry(lp.token_id, lp.logprob);
                ChatTokenLogprob {
                    token: chosen.token,
                    logprob: chosen.logprob,
                    bytes: chosen.bytes,
                    top_logprobs: lp.top.iter().map(|&(id, l)| entry(id, l)).collect(),
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use novainfer_core::FinishReason;

    fn delta(
        index: usize,
        ids: &[u32],
        text: &str,
        finish: Option<FinishReason>,
        cached: usize,
    ) -> Delta {
        Delta {
            index,
            text: text.into(),
            token_ids: ids.to_vec(),
            finish_reason: finish,
            num_cached_tokens: cached,
            ..Delta::default()
        }
    }

    #[test]
    fn choices_are_prompt_major_and_usage_adds_up() {
        let metrics = ModelMetrics::default();
        let t0 = Instant::now();
        let mut run = RunState::new(t0, vec![5, 7], 2);
        assert_eq!(
            run.record(1, &delta(1, &[3], "a", None, 4), &metrics, t0),
            3
        );
        assert_eq!(
            run.record(
                0,
                &delta(0, &[3, 4], "bc", Some(FinishReason::Stop), 0),
                &metrics,
                t0
            ),
            0
        );
        run.record(
            1,
            &delta(1, &[9], "d", Some(FinishReason::Length), 4),
            &metrics,
            t0,
        );
        assert_eq!(run.choices[3].text, "ad");
        assert_eq!(run.choices[3].finish_reason, Some("length"));
        assert_eq!(run.finish_reason(), "stop");
        assert!(!run.all_finished());
        assert_eq!(run.usage(), Usage::new(12, 4, 4));
    }

    #[test]
    fn usage_sums_the_drafts_of_every_choice_and_omits_them_without_any() {
        let metrics = ModelMetrics::default();
        let t0 = Instant::now();
        let mut run = RunState::new(t0, vec![5], 2);
        run.record(0, &delta(0, &[3], "a", None, 0), &metrics, t0);
        let json = serde_json::to_value(run.usage()).expect("serializes");
        assert!(json.get("speculative_decoding").is_none(), "{json}");
        for (index, drafted, accepted) in [(0, 4, 3), (1, 2, 0), (0, 1, 1)] {
            let mut d = delta(index, &[7, 8], "bc", None, 0);
            d.speculation = Speculation {
                num_draft_tokens: drafted,
                num_accepted_tokens: accepted,
            };
            run.record(0, &d, &metrics, t0);
        }
        let json = serde_json::to_value(run.usage()).expect("serializes");
        assert_eq!(
            json["speculative_decoding"],
            serde_json::json!({"num_draft_tokens": 7, "num_accepted_tokens": 4})
        );
    }
}
