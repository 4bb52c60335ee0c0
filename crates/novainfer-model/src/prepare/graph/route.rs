//! Per step: replay a decode graph, or launch eagerly.
//!
//! A graph is captured for one shape of step only: one query token per sequence, every
//! sequence's row sampled in order (logits or a device draw), at most the largest bucket of
//! sequences. Everything else (prefill, chunked prefill, mixed steps, embeddings) runs eagerly,
//! as do steps while graphs are off. A speculative verify or a scored prompt reaches here cut
//! into one-token sampled spans (`ForwardBatch::row_passes`): those passes replay.

use super::buckets::GraphBuckets;
use crate::forward_batch::{ForwardBatch, SpanOutput};

/// How one step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepRoute {
    /// Padded to `bucket` sequences and replayed.
    Graph {
        bucket: usize,
    },
    Eager(EagerReason),
}

/// Why a step runs eagerly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EagerReason {
    /// Graphs are off (the default, or `enforce_eager`).
    GraphsOff,
    /// No sequence has a token in this step.
    Empty,
    /// A sequence has more than one query token (prefill, chunked prefill, a verify).
    NotDecode,
    /// A sequence's row is not sampled, or asks for more than its last row's logits or token
    /// (a prompt still being read, scoring, an embedding): the graph samples every row.
    NotSampled,
    /// More sequences than the largest bucket.
    AboveLargestBucket,
}

/// The route of `batch` (a step whose result is logits or drawn tokens, never hidden
/// states) with the captured `buckets` (`None`: graphs are off).
pub fn route(batch: &ForwardBatch, buckets: Option<&GraphBuckets>) -> StepRoute {
    let Some(buckets) = buckets else {
        return StepRoute::Eager(EagerReason::GraphsOff);
    };
    let spans: Vec<_> = batch.seqs.iter().filter(|s| s.query_len > 0).collect();
    if spans.is_empty() {
        return StepRoute::Eager(EagerReason::Empty);
    }
    if spans.iter().any(|s| s.query_len != 1) {
        return StepRoute::Eager(EagerReason::NotDecode);
    }
    let sampled = |s: &&&crate::forward_batch::SeqSpan| {
        matches!(s.output, SpanOutput::LastLogits | SpanOutput::Draw(_))
    };
    if !spans.iter().all(|s| sampled(&s)) {
        return StepRoute::Eager(EagerReason::NotSampled);
    }
    match buckets.bucket_for(spans.len()) {
        Some(bucket) => StepRoute::Graph { bucket },
        None => StepRoute::Eager(EagerReason::AboveLargestBucket),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward_batch::Draw;

    /// `n` sequences decoding one token each, at position 5 of a one-block table.
    fn decode(n: usize) -> ForwardBatch {
        let mut b = ForwardBatch::default();
        for i in 0..n {
            b.push(&[7], 5, vec![i * 8 + 5], vec![i as u32], true);
        }
        b
    }

    fn buckets() -> GraphBuckets {
        GraphBuckets::new(8).expect("rows")
    }

    #[test]
    fn pure_decode_replays_the_smallest_bucket() {
        assert_eq!(
            route(&decode(1), Some(&buckets())),
            StepRoute::Graph { bucket: 1 }
        );
        assert_eq!(
            route(&decode(3), Some(&buckets())),
            StepRoute::Graph { bucket: 4 }
        );
        assert_eq!(
            route(&decode(8), Some(&buckets())),
            StepRoute::Graph { bucket: 8 }
        );
        let mut drawn = ForwardBatch::default();
        drawn.push_span(&[7], 5, vec![5], vec![0], SpanOutput::Draw(Draw::greedy()));
        drawn.push_span(
            &[8],
            9,
            vec![17],
            vec![1, 2],
            SpanOutput::Draw(Draw::greedy()),
        );
        assert_eq!(
            route(&drawn, Some(&buckets())),
            StepRoute::Graph { bucket: 2 }
        );
    }

    #[test]
    fn graphs_off_is_always_eager() {
        assert_eq!(
            route(&decode(2), None),
            StepRoute::Eager(EagerReason::GraphsOff)
        );
    }

    #[test]
    fn above_the_largest_bucket_is_eager() {
        assert_eq!(
            route(&decode(9), Some(&buckets())),
            StepRoute::Eager(EagerReason::AboveLargestBucket)
        );
    }

    #[test]
    fn prefill_mixed_and_verify_steps_are_eager() {
        let mut mixed = decode(2);
        mixed.push(&[1, 2, 3], 0, vec![40, 41, 42], vec![5], true);
        assert_eq!(
            route(&mixed, Some(&buckets())),
            StepRoute::Eager(EagerReason::NotDecode)
        );
        let mut verify = ForwardBatch::default();
        let each = vec![Draw::greedy(); 3];
        verify.push_span(
            &[1, 2, 3],
            4,
            vec![4, 5, 6],
            vec![0, 1],
            SpanOutput::DrawEach(each),
        );
        assert_eq!(
            route(&verify, Some(&buckets())),
            StepRoute::Eager(EagerReason::NotDecode)
        );
        // A one-token verify or score is still not a plain sampled row.
        let mut one = decode(1);
        one.push_span(&[1], 4, vec![12], vec![1, 2], SpanOutput::AllLogits);
        assert_eq!(
            route(&one, Some(&buckets())),
            StepRoute::Eager(EagerReason::NotSampled)
        );
    }

    #[test]
    fn an_unsampled_or_embedding_row_is_eager_and_empty_spans_do_not_count() {
        let mut quiet = decode(1);
        quiet.push(&[3], 0, vec![16], vec![2], false);
        assert_eq!(
            route(&quiet, Some(&buckets())),
            StepRoute::Eager(EagerReason::NotSampled)
        );
        let mut hidden = decode(1);
        hidden.push_span(&[3], 0, vec![16], vec![2], SpanOutput::LastHidden);
        assert_eq!(
            route(&hidden, Some(&buckets())),
            StepRoute::Eager(EagerReason::NotSampled)
        );
        let mut with_empty = decode(2);
        with_empty.push(&[], 0, vec![], vec![3], true);
        assert_eq!(
            route(&with_empty, Some(&buckets())),
            StepRoute::Graph { bucket: 2 }
        );
        assert_eq!(
            route(&ForwardBatch::default(), Some(&buckets())),
            StepRoute::Eager(EagerReason::Empty)
        );
    }
}
