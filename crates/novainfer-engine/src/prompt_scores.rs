//! Logprobs of a prompt's own tokens (`echo` with `logprobs`: scoring a text): from the
//! next-token logits at prompt position `p`, `log_softmax(row)[prompt[p + 1]]` and the row's
//! top alternatives. The first token has none (nothing precedes it), as in OpenAI.
//!
//! The engine reduces each logits row to this as soon as a scored chunk's rows arrive, so
//! a long prompt costs a few floats per token, not a vocabulary-sized row.

use crate::request::TokenLogprob;

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

/// The logprob of `next` under the logits `row`, with the `k` most likely alternatives.
pub fn row_logprob(row: &[f32], next: u32, k: usize) -> TokenLogprob {
    let lse = log_sum_exp(row);
    let lp = |x: f32| (f64::from(x) - lse) as f32;
    let chosen = row.get(next as usize).copied();
    TokenLogprob {
        token_id: next,
        logprob: chosen.map_or(f32::NEG_INFINITY, lp),
        top: top_k(row, k)
            .into_iter()
            .map(|(id, x)| (id, lp(x)))
            .collect(),
        // 1 for the most likely token, as vLLM's `Logprob.rank`.
        rank: chosen.map_or(0, |x| row.iter().filter(|&&y| y >= x).count() as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_of_the_next_token() {
        let first = row_logprob(&[0.0, (2.0f32).ln(), 0.0], 1, 2);
        assert_eq!(first.token_id, 1);
        assert!((first.logprob - (0.5f32).ln()).abs() < 1e-6);
        assert_eq!(first.top[0].0, 1);
        let second = row_logprob(&[5.0, 5.0, 5.0], 2, 2);
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
