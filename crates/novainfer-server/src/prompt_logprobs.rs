//! Logprobs of the prompt's own tokens, for `echo` with `logprobs` (scoring a text): from
//! the next-token logits at every prompt position, `log_softmax(row i)[prompt[i + 1]]` and
//! the row's top alternatives. The first token has none (nothing precedes it), as in OpenAI.
//!
//! The engine returns a full-vocabulary logits row per prompt token, so the prompt length
//! this may be used for is capped by [`MAX_PROMPT_LOGITS`] floats.

use novainfer_engine::TokenLogprob;

/// At most this many logits (prompt tokens × vocabulary) per request: 128 MiB of f32.
pub const MAX_PROMPT_LOGITS: usize = 32 << 20;

fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    let sum: f64 = row
        .iter()
        .map(|&x| (f64::from(x) - f64::from(max)).exp())
        .sum();
    f64::from(max) + sum.ln()
}

/// The `k` largest entries of `row` as `(index, value)`, largest first (ties: lower index first).
fn top_k(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return top;
    }
    for (i, &x) in row.iter().enumerate() {
        if top.len() == k && top.last().is_some_and(|&(_, v)| x <= v) {
            continue;
        }
        let at = top.partition_point(|&(_, v)| v >= x);
        top.insert(at, (i as u32, x));
        top.truncate(k);
    }
    top
}

/// One entry per prompt token: `None` for the first, then each token's logprob given the
/// ones before it, with the `k` most likely alternatives. `logits` holds one row per token.
pub fn prompt_logprobs(logits: &[f32], prompt_ids: &[u32], k: usize) -> Vec<Option<TokenLogprob>> {
    let Some(vocab) = logits.len().checked_div(prompt_ids.len()) else {
        return Vec::new();
    };
    let mut out = vec![None];
    for (row, &next) in logits.chunks_exact(vocab).zip(prompt_ids.iter().skip(1)) {
        let lse = log_sum_exp(row);
        let lp = |x: f32| (f64::from(x) - lse) as f32;
        let chosen = row.get(next as usize).copied();
        out.push(Some(TokenLogprob {
            token_id: next,
            logprob: chosen.map_or(f32::NEG_INFINITY, lp),
            top: top_k(row, k)
                .into_iter()
                .map(|(id, x)| (id, lp(x)))
                .collect(),
            rank: chosen.map_or(0, |x| row.iter().filter(|&&y| y >= x).count() as u32),
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_of_each_next_token() {
        // Three positions (one row each; the last predicts past the prompt), vocabulary of 3.
        let logits = [0.0, (2.0f32).ln(), 0.0, 5.0, 5.0, 5.0, 9.0, 0.0, 0.0];
        let out = prompt_logprobs(&logits, &[7, 1, 2], 2);
        assert_eq!(out.len(), 3);
        assert!(out[0].is_none());
        let first = out[1].as_ref().expect("second token");
        assert_eq!(first.token_id, 1);
        assert!((first.logprob - (0.5f32).ln()).abs() < 1e-6);
        assert_eq!(first.top[0].0, 1);
        let second = out[2].as_ref().expect("third token");
        assert!((second.logprob - (1.0f32 / 3.0).ln()).abs() < 1e-6);
        assert_eq!(
            second.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![0, 1]
        );
    }

    #[test]
    fn top_k_is_sorted_and_stable() {
        assert_eq!(
            top_k(&[1.0, 3.0, 3.0, 2.0], 3),
            vec![(1, 3.0), (2, 3.0), (3, 2.0)]
        );
        assert!(top_k(&[1.0], 0).is_empty());
    }
}
