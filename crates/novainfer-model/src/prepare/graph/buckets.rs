//! The batch sizes a decode graph is captured for.

/// vLLM's decode capture sizes up to 256: powers of two keep the padding under half a batch
/// with few graphs (each costs capture time and a little device memory at start-up).
pub const BUCKET_LADDER: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// The captured batch sizes, ascending and never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphBuckets {
    sizes: Vec<usize>,
}

impl GraphBuckets {
    /// The ladder's sizes up to `max_rows`, the most sequences a step's buffers hold
    /// (`max_num_seqs`, and `max_num_batched_tokens`, since a decode step has a token per
    /// sequence): a bucket past it could not be uploaded. When `max_rows` is below 256 and
    /// not on the ladder it is a bucket of its own, so every batch the buffers hold has one
    /// (with `max_num_seqs = 48`, a batch of 40 pads to 48, not to an impossible 64).
    /// `None` for `max_rows = 0`.
    pub fn new(max_rows: usize) -> Option<Self> {
        if max_rows == 0 {
            return None;
        }
        let mut sizes: Vec<usize> = BUCKET_LADDER
            .iter()
            .copied()
            .filter(|&b| b <= max_rows)
            .collect();
        let top = BUCKET_LADDER[BUCKET_LADDER.len() - 1];
        if max_rows < top && sizes.last() != Some(&max_rows) {
            sizes.push(max_rows);
        }
        Some(Self { sizes })
    }

    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    pub fn largest(&self) -> usize {
        self.sizes[self.sizes.len() - 1]
    }

    /// The smallest bucket that holds `num_seqs` sequences; `None` for an empty step or one
    /// above the largest bucket (which runs eagerly).
    pub fn bucket_for(&self, num_seqs: usize) -> Option<usize> {
        if num_seqs == 0 {
            return None;
        }
        self.sizes.iter().copied().find(|&b| b >= num_seqs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ladder_is_clamped_by_the_buffers() {
        let b = GraphBuckets::new(64).expect("rows");
        assert_eq!(b.sizes(), [1, 2, 4, 8, 16, 32, 64]);
        assert_eq!(b.largest(), 64);
        let b = GraphBuckets::new(1000).expect("rows");
        assert_eq!(b.sizes(), BUCKET_LADDER, "256 is the largest graph");
        assert_eq!(GraphBuckets::new(1).expect("rows").sizes(), [1]);
        assert_eq!(GraphBuckets::new(0), None);
    }

    #[test]
    fn a_limit_off_the_ladder_is_its_own_bucket() {
        let b = GraphBuckets::new(48).expect("rows");
        assert_eq!(b.sizes(), [1, 2, 4, 8, 16, 32, 48]);
        assert_eq!(b.bucket_for(40), Some(48));
        assert_eq!(GraphBuckets::new(3).expect("rows").sizes(), [1, 2, 3]);
    }

    #[test]
    fn a_batch_pads_to_the_smallest_bucket_that_holds_it() {
        let b = GraphBuckets::new(64).expect("rows");
        assert_eq!(b.bucket_for(1), Some(1));
        assert_eq!(b.bucket_for(3), Some(4));
        assert_eq!(b.bucket_for(4), Some(4));
        assert_eq!(b.bucket_for(5), Some(8));
        assert_eq!(b.bucket_for(33), Some(64));
        assert_eq!(b.bucket_for(64), Some(64));
    }

    #[test]
    fn empty_and_oversized_batches_have_no_bucket() {
        let b = GraphBuckets::new(64).expect("rows");
        assert_eq!(b.bucket_for(0), None);
        assert_eq!(b.bucket_for(65), None);
        let b = GraphBuckets::new(512).expect("rows");
        assert_eq!(b.bucket_for(256), Some(256));
        assert_eq!(b.bucket_for(257), None, "above the largest graph: eager");
    }
}
