//! Turning a step's logits rows into tokens: sampling a row (masked by the request's grammar)
//! and verifying a speculative draft.

use std::sync::Arc;

use novainfer_core::RequestId;
use novainfer_model::sampler::{SampledToken, Sampler};
use novainfer_structured::{Constraint, Progress};

/// What the grammars said about this step's tokens, for `update`.
#[derive(Default)]
pub struct GrammarOutcomes {
    /// Complete: the request ends with `stop` on this token.
    pub finished: Vec<RequestId>,
    /// The matcher failed (a bug in the grammar engine): the request fails.
    pub failed: Vec<(RequestId, String)>,
}

/// Samples one row, masked by the request's grammar when it has one, and advances the grammar
/// by the token; the next mask starts computing at once, off this thread, so it is ready by the
/// time the next forward pass is.
pub fn sample_row(
    id: RequestId,
    sampler: &mut Sampler,
    constraint: Option<&mut Constraint>,
    row: &mut [f32],
    outcomes: &mut GrammarOutcomes,
) -> SampledToken {
    let Some(constraint) = constraint else {
        return sampler.sample(row);
    };
    if let Err(e) = constraint.apply_mask(row) {
        outcomes.failed.push((id, e.to_string()));
        return sampler.sample(row);
    }
    let token = sampler.sample(row);
    advance_grammar(id, constraint, token.token_id, outcomes);
    token
}

/// Advances request `id`'s grammar past `token` (which its mask allowed) and notes what it
/// said; the next mask starts computing at once, off this thread.
pub fn advance_grammar(
    id: RequestId,
    constraint: &mut Constraint,
    token: u32,
    outcomes: &mut GrammarOutcomes,
) {
    match constraint.accept(token) {
        Ok(Progress::Finished) => outcomes.finished.push(id),
        Ok(Progress::Continue) => constraint.prefetch(),
        Err(e) => outcomes.failed.push((id, e.to_string())),
    }
}

/// The grammar's mask of the next token as a device takes it: `⌈vocab / 32⌉` words (ids past
/// the grammar's vocabulary disallowed). `None` when the grammar fails to give one: the row is
/// then sampled on the host, whose path reports the failure.
pub fn device_mask(constraint: &mut Constraint, vocab: usize) -> Option<Arc<[u32]>> {
    let mut words = constraint.mask_words().ok()?;
    words.resize(vocab.div_ceil(32), 0);
    Some(words.into())
}

/// [`sample_row`], except that on a backend that draws tokens itself (`device_draws`) a row
/// the device could have drawn is sampled here by the device's rule, through its CPU twin
/// ([`novainfer_model::Draw::on_host`]). A request's tokens then come from one random stream
/// whichever side sampled each row: the first row of an n > 1 request, which all its
/// completions sample from copies of here, draws what a lone request with the same seed
/// draws on the device.
pub fn sample_row_as_device(
    device_draws: bool,
    id: RequestId,
    sampler: &mut Sampler,
    mut constraint: Option<&mut Constraint>,
    row: &mut [f32],
    outcomes: &mut GrammarOutcomes,
) -> SampledToken {
    if device_draws {
        let draw = sampler.device_draw().and_then(|mut draw| {
            if let Some(c) = constraint.as_deref_mut() {
                draw.allowed = Some(device_mask(c, row.len())?);
            }
            Some(draw)
        });
        if let Some(token) = draw.and_then(|d| d.on_host(row).ok()) {
            let token = sampler.accept_drawn(token);
            if let Some(c) = constraint {
                advance_grammar(id, c, token.token_id, outcomes);
            }
            return token;
        }
    }
    sample_row(id, sampler, constraint, row, outcomes)
}

/// Verifies request `id`'s draft: samples the rows (`draft.len() + 1` of them) in order (row
/// `i` follows draft token `i - 1`) and stops at the first token that is not the draft's, or when the grammar ends.
/// Every output token is thus sampled from the target's own distribution after the tokens
/// before it, with the same sampler and random stream as without a draft: greedy and seeded
/// outputs are the same token for token. For a one-hot draft this is rejection sampling: a
/// draft token `x` is kept with probability `p(x)`, and a rejected one is replaced by a sample
/// of `p` without `x`. Returns the confirmed draft tokens and the token after them.
///
/// `device_draws`: the backend draws rows itself, so each row here is sampled by the device's
/// rule ([`sample_row_as_device`]) and a seeded request keeps one random stream whichever side
/// sampled its verify.
pub fn verify_draft(
    device_draws: bool,
    id: RequestId,
    sampler: &mut Sampler,
    mut constraint: Option<&mut Constraint>,
    draft: &[u32],
    rows: &mut [f32],
    outcomes: &mut GrammarOutcomes,
) -> Vec<SampledToken> {
    // A row for the token before the draft and one for each draft token.
    let vocab = rows.len() / (draft.len() + 1);
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    for (i, row) in rows.chunks_exact_mut(vocab).enumerate() {
        let token = sample_row_as_device(
            device_draws,
            id,
            sampler,
            constraint.as_deref_mut(),
            row,
            outcomes,
        );
        let confirmed = draft.get(i) == Some(&token.token_id);
        tokens.push(token);
        let grammar_ended =
            outcomes.finished.contains(&id) || outcomes.failed.iter().any(|(f, _)| *f == id);
        if !confirmed || grammar_ended {
            break;
        }
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;
    use novainfer_core::SamplingParams;

    /// The two-sample chi-square statistic: whether `a` and `b` are counts of draws from one
    /// distribution (degrees of freedom: the categories with any count, less one).
    fn chi_square(a: &[usize], b: &[usize]) -> f64 {
        let (na, nb) = (
            a.iter().sum::<usize>() as f64,
            b.iter().sum::<usize>() as f64,
        );
        let (ka, kb) = ((nb / na).sqrt(), (na / nb).sqrt());
        a.iter()
            .zip(b)
            .filter(|(&x, &y)| x + y > 0)
            .map(|(&x, &y)| (ka * x as f64 - kb * y as f64).powi(2) / (x + y) as f64)
            .sum()
    }

    /// Draws from the target's sampling distribution for `logits` under `params`, as a sampler
    /// without drafts makes them (each with its own seed).
    fn reference(params: &SamplingParams, logits: &[f32], trials: usize) -> Vec<usize> {
        let mut counts = vec![0usize; logits.len()];
        for seed in 0..trials as u64 {
            let mut sampler = Sampler::new(params, &[], 1_000_000 + seed);
            counts[sampler.sample(&mut logits.to_vec()).token_id as usize] += 1;
        }
        counts
    }

    /// Verified outputs are distributed as the target's own samples: the first token's, and the
    /// second's after a confirmed first draft, for several sampler settings and drafts both
    /// likely and unlikely.
    #[test]
    fn verification_keeps_the_target_distribution() {
        let row0 = [2.0f32, 1.0, 0.5, 0.0, -1.0, 1.5];
        let row1 = [0.0f32, 0.3, 2.5, -0.5, 1.0, 0.2];
        let vocab = row0.len();
        let settings = [
            SamplingParams::builder().temperature(1.0),
            SamplingParams::builder().temperature(0.7).top_k(4),
            SamplingParams::builder().temperature(1.3).top_p(0.8),
            SamplingParams::builder().temperature(1.0).min_p(0.2),
        ];
        const TRIALS: usize = 20_000;
        // 5 degrees of freedom at most: 20.5 is the 0.999 quantile.
        const CRITICAL: f64 = 20.5;
        for builder in settings {
            let params = builder.build().expect("valid");
            let p0 = reference(&params, &row0, TRIALS);
            let p1 = reference(&params, &row1, TRIALS);
            for draft in [[0u32, 2], [4, 1]] {
                let mut first = vec![0usize; vocab];
                let mut second = vec![0usize; vocab];
                for seed in 0..TRIALS as u64 {
                    let mut sampler = Sampler::new(&params, &[], seed);
                    // Row i follows the draft's first i tokens (the third's values are not looked at).
                    let rows = row0.iter().chain(&row1).chain(&row0);
                    let mut rows: Vec<f32> = rows.copied().collect();
                    let out = verify_draft(
                        false,
                        RequestId(1),
                        &mut sampler,
                        None,
                        &draft,
                        &mut rows,
                        &mut GrammarOutcomes::default(),
                    );
                    first[out[0].token_id as usize] += 1;
                    let kept = out[0].token_id == draft[0];
                    // A row after each draft token: a token per kept draft token and one more.
                    let kept_both = kept && out[1].token_id == draft[1];
                    assert_eq!(
                        out.len(),
                        1 + kept as usize + kept_both as usize,
                        "stops at a rejection"
                    );
                    if kept {
                        second[out[1].token_id as usize] += 1;
                    }
                }
                let x = chi_square(&first, &p0);
                assert!(
                    x < CRITICAL,
                    "first token: chi2 {x} for {params:?} draft {draft:?}"
                );
                if second.iter().sum::<usize>() > 1000 {
                    let x = chi_square(&second, &p1);
                    assert!(x < CRITICAL, "second token: chi2 {x} for {params:?}");
                }
            }
        }
    }
}
