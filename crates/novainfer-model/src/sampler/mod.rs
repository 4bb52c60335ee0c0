//! The per-sequence sampler: raw logits row in, one token (with its logprobs) out.
//!
//! One [`Sampler`] per sequence owns that sequence's RNG and penalty history, so a request's
//! tokens depend only on its own logits and seed, never on what else shares the batch.
//! Semantics follow vLLM:
//!
//! 1. logprobs come from `log_softmax` of the RAW row (vLLM's default `raw_logprobs`);
//! 2. repetition, frequency and presence penalties change the row ([`penalties`]), then
//!    `logit_bias` and the `min_tokens` mask ([`logit_adjust`]);
//! 3. greedy (temperature 0, below vLLM's 1e-5 sampling epsilon, or top-k 1) takes the
//!    argmax, lowest id on ties, and leaves the RNG untouched;
//! 4. otherwise temperature, top-k, top-p, min-p, then one draw from a ChaCha8 stream seeded
//!    with the request's seed or the engine's fallback ([`truncation`]).
//!
//! NaN logits count as `-inf` and `+inf` as `f32::MAX`; nothing here panics on any row.

mod logit_adjust;
mod penalties;
pub(crate) mod row_math;
mod truncation;

use novainfer_core::SamplingParams;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::draw::{Adjust, Draw, DrawRule, DrawnToken, RowEdit, MAX_DEVICE_EDITS};
use logit_adjust::LogitAdjust;
use penalties::{Penalties, PenaltyState};
use row_math::BlockMaxima;
use truncation::Truncation;

/// vLLM's `_SAMPLING_EPS`: temperatures below it sample greedily, which also keeps
/// `1 / temperature` finite.
const MIN_SAMPLING_TEMPERATURE: f32 = 1e-5;

/// One sampled token with its raw logprob and, when asked for, the top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub token_id: u32,
    /// `log_softmax(raw logits)[token_id]`.
    pub logprob: f32,
    /// The `logprobs` most likely tokens of the raw row as `(id, logprob)`, by logprob
    /// descending then id ascending; empty when the request asked for none.
    pub top_logprobs: Vec<(u32, f32)>,
    /// The token's rank in the raw row (1 = most likely; the number of ids whose logit is at
    /// least its own, as vLLM counts), when logprobs were asked for; else 0.
    pub rank: u32,
}

/// Sampling state of one sequence.
#[derive(Debug, Clone)]
pub struct Sampler {
    greedy: bool,
    /// The request's temperature (the truncation keeps its inverse).
    temperature: f32,
    truncation: Truncation,
    num_top_logprobs: Option<usize>,
    /// The key of the device's counter-based draws ([`Self::device_draw`]); the host's own
    /// stream is `rng`, seeded from the same value.
    seed: u64,
    /// Tokens sampled so far, here or on the device: the device draw's counter.
    sampled: u64,
    rng: ChaCha8Rng,
    penalties: PenaltyState,
    adjust: LogitAdjust,
    scratch: Scratch,
}

impl Sampler {
    /// `prompt_ids` feed the repetition penalty; `fallback_seed` seeds the RNG when the
    /// request has no seed (the engine derives it from its own seed and a request counter).
    pub fn new(params: &SamplingParams, prompt_ids: &[u32], fallback_seed: u64) -> Self {
        let temperature = params.temperature();
        let greedy = params.is_greedy() || temperature < MIN_SAMPLING_TEMPERATURE;
        let seed = params.seed().unwrap_or(fallback_seed);
        Self {
            greedy,
            temperature,
            seed,
            sampled: 0,
            truncation: Truncation {
                inv_temperature: if greedy { 1.0 } else { 1.0 / temperature },
                top_k: params.top_k(),
                top_p: params.top_p(),
                min_p: params.min_p(),
            },
            num_top_logprobs: params.logprobs(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            penalties: PenaltyState::new(Penalties::from_params(params), prompt_ids),
            adjust: LogitAdjust::new(params),
            scratch: Scratch::default(),
        }
    }

    /// The model's EOS ids, which `min_tokens` holds back like the request's stop token ids
    /// (unless the request ignores EOS).
    pub fn with_eos_token_ids(mut self, eos_token_ids: &[u32], ignore_eos: bool) -> Self {
        self.adjust.mask_eos(eos_token_ids, ignore_eos);
        self
    }

    /// Picks the next token from one row of raw logits (`len == vocab`) and records it for
    /// the penalties of later steps. On return `logits` holds the raw row again, except that
    /// NaN became `-inf` and `+inf` became `f32::MAX`.
    pub fn sample(&mut self, logits: &mut [f32]) -> SampledToken {
        let maxima = &mut self.scratch.maxima;
        if !maxima.scan(logits) {
            row_math::sanitize(logits);
            maxima.scan(logits);
        }
        let raw_max = maxima.max();
        // The cache is keyed by (max, scale) only; a new row must never reuse the last one's.
        self.scratch.draw.sums.invalidate();
        // The same pass doubles as the untruncated draw's normaliser at temperature 1.
        let raw_log_total = self.scratch.draw.sums.total(logits, raw_max, 1.0).ln();
        let log_softmax = |x: f32| -> f32 {
            if raw_max == f32::NEG_INFINITY {
                f32::NEG_INFINITY
            } else {
                (f64::from(x) - f64::from(raw_max) - raw_log_total) as f32
            }
        };
        let top_logprobs = match self.num_top_logprobs {
            Some(n) => row_math::top_n(logits, &self.scratch.maxima, n)
                .into_iter()
                .map(|(id, x)| (id, log_softmax(x)))
                .collect(),
            None => Vec::new(),
        };

        let penalized = self.penalties.apply(logits);
        if self.adjust.apply(logits) || penalized {
            self.scratch.draw.sums.invalidate();
            self.scratch.maxima.scan(logits);
        }
        let token_id = if self.greedy {
            row_math::first_index_of_max(logits, &self.scratch.maxima) as u32
        } else {
            let u: f64 = self.rng.random();
            let Scratch { maxima, draw } = &mut self.scratch;
            truncation::draw(logits, maxima, &self.truncation, u, draw)
        };
        // Reverse order of application: the penalties' saved values are the raw ones.
        self.adjust.restore(logits);
        self.penalties.restore(logits);
        self.penalties.record(token_id);
        self.sampled += 1;

        let chosen = logits.get(token_id as usize).copied();
        let logprob = chosen.map_or(f32::NEG_INFINITY, log_softmax);
        let rank = match (self.num_top_logprobs, chosen) {
            (Some(_), Some(x)) => logits.iter().filter(|&&y| y >= x).count() as u32,
            _ => 0,
        };
        SampledToken {
            token_id,
            logprob,
            top_logprobs,
            rank,
        }
    }
}

impl Sampler {
    /// The next token as a device may draw it ([`Draw`]): the penalties, logit bias and
    /// `min_tokens` mask as edits of the row (at most [`MAX_DEVICE_EDITS`]), the logprobs
    /// asked for as the draw's. `None` means: sample the logits row here.
    ///
    /// A drawn token follows the same distribution as one sampled here, from a different
    /// random stream (the device's counter-based generator keyed by the request's seed, at the
    /// count of tokens sampled so far); greedy rows are the same token either way.
    pub fn device_draw(&self) -> Option<Draw> {
        self.draw_after(0)
    }

    /// The draw of the token after the next, before the next is known: what
    /// [`Self::device_draw`] gives once the next is accepted. Only counts change with it (the
    /// generator's offset, `min_tokens`), unless penalties are on, which depend on which token
    /// it is: `None` then. A step scheduled ahead (async scheduling) draws with it.
    pub fn device_draw_after_next(&self) -> Option<Draw> {
        if self.penalties.is_active() {
            return None;
        }
        self.draw_after(1)
    }

    /// The draw of the token `ahead` tokens from now, as if those were accepted; penalties as
    /// they stand now (the callers make sure they are either off or `ahead` is 0).
    fn draw_after(&self, ahead: usize) -> Option<Draw> {
        let adjust = if self.penalties.is_active() || self.adjust.is_active_after(ahead) {
            Some(Arc::new(self.device_edits(ahead)?))
        } else {
            None
        };
        let rule = if self.greedy {
            DrawRule::Greedy
        } else {
            DrawRule::Random {
                temperature: self.temperature,
                top_k: self.truncation.top_k,
                top_p: self.truncation.top_p,
                min_p: self.truncation.min_p,
            }
        };
        Some(Draw {
            seed: self.seed,
            offset: self.sampled + ahead as u64,
            rule,
            adjust,
            logprobs: self.num_top_logprobs,
            allowed: None,
        })
    }

    /// This sampler's changes to the row `ahead` tokens from now as one edit per token, in id
    /// order; `None` past [`MAX_DEVICE_EDITS`].
    fn device_edits(&self, ahead: usize) -> Option<Adjust> {
        fn edit(edits: &mut BTreeMap<u32, RowEdit>, id: u32) -> &mut RowEdit {
            edits.entry(id).or_insert(RowEdit {
                token_id: id,
                output_count: 0,
                flags: 0,
                bias: 0.0,
            })
        }
        let mut edits = BTreeMap::new();
        let (penalties, touched) = self.penalties.touched();
        if self.penalties.is_active() {
            for (id, in_prompt, count) in touched {
                let e = edit(&mut edits, id);
                e.flags |= RowEdit::PENALIZE | if in_prompt { RowEdit::IN_PROMPT } else { 0 };
                e.output_count = count;
            }
        }
        let (bias, masked) = self.adjust.pending_after(ahead);
        for &(id, b) in bias {
            edit(&mut edits, id).bias = b;
        }
        for &id in masked {
            edit(&mut edits, id).flags |= RowEdit::MASK;
        }
        (edits.len() <= MAX_DEVICE_EDITS).then(|| Adjust {
            penalties: penalties.for_device(),
            edits: edits.into_values().collect(),
        })
    }

    /// Takes a token the device drew for [`Self::device_draw`] as this sampler's next one.
    pub fn accept_drawn(&mut self, drawn: DrawnToken) -> SampledToken {
        self.penalties.record(drawn.token_id);
        self.adjust.count_sampled();
        self.sampled += 1;
        SampledToken {
            token_id: drawn.token_id,
            logprob: drawn.logprob,
            top_logprobs: drawn.top_logprobs,
            rank: drawn.rank,
        }
    }
}

/// Buffers reused from step to step so that sampling allocates nothing once warm.
#[derive(Debug, Clone, Default)]
struct Scratch {
    maxima: BlockMaxima,
    draw: truncation::Scratch,
}

#[cfg(test)]
mod tests;
