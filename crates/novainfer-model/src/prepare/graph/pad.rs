//! A decode step padded to its bucket, and where in the metadata buffer a bucket's graph
//! reads it.
//!
//! Padding rules (each row past the step's own is inert and its results are never read):
//!
//! | array           | padded row                 | why harmless                                  |
//! |-----------------|----------------------------|-----------------------------------------------|
//! | token_ids       | 0                          | a real id: the embedding gathers a valid row  |
//! | positions       | 0                          | inside the RoPE table                         |
//! | slot_mapping    | −1                         | the KV write skips negative slots (qkv.cu)    |
//! | seq_lens        | 0                          | attention reads nothing, writes a zero row    |
//! | block_tables    | a row of block 0           | never read (seq_len 0)                        |
//! | query_start_loc | +1 a row                   | one token each, as a decode step's            |
//! | sample_rows     | the row itself             | its logits are computed and never copied back |
//!
//! The sampling arrays (draw modes, parameters, edits, logprobs, masks) are not padded: the
//! sampling tail runs after the replay over the step's own rows only.

use crate::prepare::{PackedStep, StepLayout};

/// `step` padded to `bucket` sequences for a graph whose block tables are `width` entries a
/// row; `None` unless `step` is a decode step of at most `bucket` sequences whose rows are all
/// sampled in order (what [`super::route`] sends to a graph).
pub fn pad_to_bucket(step: &PackedStep, bucket: usize, width: usize) -> Option<PackedStep> {
    fits_bucket(step, bucket, width).then(|| padded(step.clone(), bucket, width))
}

/// Whether [`pad_to_bucket`] takes `step`: the executor asks before it routes a step to a
/// graph, so a step `route` sends there but the padding refuses runs eagerly, not as an error.
pub fn fits_bucket(step: &PackedStep, bucket: usize, width: usize) -> bool {
    let s = step.num_seqs();
    let identity = step.sample_rows.iter().copied().eq(0..s as i32);
    let decode = s > 0 && step.decode_only && step.num_tokens() == s;
    s <= bucket && decode && identity && step.block_tables.len() == s * width
}

/// The step a bucket's graph is captured with: padding rows only. Its launches are recorded,
/// not run, and the same arrays in the same places serve every later replay.
pub fn capture_step(bucket: usize, width: usize) -> PackedStep {
    let empty = PackedStep {
        query_start_loc: vec![0],
        edit_offsets: vec![0],
        decode_only: true,
        ..PackedStep::default()
    };
    padded(empty, bucket, width)
}

fn padded(mut step: PackedStep, bucket: usize, width: usize) -> PackedStep {
    let s = step.num_seqs();
    for row in s..bucket {
        step.token_ids.push(0);
        step.positions.push(0);
        step.slot_mapping.push(-1);
        step.seq_lens.push(0);
        step.block_tables.extend(std::iter::repeat_n(0, width));
        step.query_start_loc.push(row as i32 + 1);
        step.sample_rows.push(row as i32);
    }
    step
}

/// The byte ranges of the metadata buffer a bucket's graph reads: fixed by the layout, the
/// same for every replay of the bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphSections {
    /// `(array, offset, bytes)`.
    pub sections: Vec<(&'static str, usize, usize)>,
}

impl GraphSections {
    pub fn new(layout: &StepLayout, bucket: usize) -> Self {
        let b = bucket;
        let sections = vec![
            ("slot_mapping", layout.slot_mapping, 8 * b),
            ("token_ids", layout.token_ids, 4 * b),
            ("positions", layout.positions, 4 * b),
            ("seq_lens", layout.seq_lens, 4 * b),
            ("sample_rows", layout.sample_rows, 4 * b),
            (
                "block_tables",
                layout.block_tables,
                4 * b * layout.max_blocks_per_seq,
            ),
        ];
        Self { sections }
    }

    /// Bytes of the buffer the graph's step must upload: through the end of its last section.
    pub fn upload_bytes(&self) -> usize {
        self.sections
            .iter()
            .map(|&(_, at, len)| at + len)
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward_batch::ForwardBatch;
    use crate::prepare::StepCapacity;

    const CAP: StepCapacity = StepCapacity {
        vocab_size: 50,
        rope_positions: 64,
        num_blocks: 10,
        block_size: 4,
        max_blocks_per_seq: 3,
        max_tokens: 8,
        max_seqs: 8,
    };

    /// Three sequences decoding at positions 5, 2 and 9.
    fn three() -> PackedStep {
        let mut b = ForwardBatch::default();
        b.push(&[7], 5, vec![4 * 6 + 1], vec![0, 6], true);
        b.push(&[8], 2, vec![4 * 3 + 2], vec![3], true);
        b.push(&[9], 9, vec![4 * 2 + 1], vec![1, 4, 2], true);
        PackedStep::pack(&b, &CAP).expect("valid")
    }

    #[test]
    fn padding_rows_are_inert_and_the_step_rows_untouched() {
        let step = three();
        let p = pad_to_bucket(&step, 4, 3).expect("fits");
        assert_eq!(p.token_ids, [7, 8, 9, 0]);
        assert_eq!(p.positions, [5, 2, 9, 0]);
        assert_eq!(p.slot_mapping, [25, 14, 9, -1], "a pad row writes no K/V");
        assert_eq!(p.seq_lens, [6, 3, 10, 0], "a pad row attends to nothing");
        assert_eq!(p.block_tables, [0, 6, 0, 3, 0, 0, 1, 4, 2, 0, 0, 0]);
        assert_eq!(p.query_start_loc, [0, 1, 2, 3, 4]);
        assert_eq!(p.sample_rows, [0, 1, 2, 3]);
        // The tail samples the step's own rows only.
        assert_eq!(p.draw_modes, step.draw_modes);
        assert_eq!(p.host_rows, step.host_rows);
        assert_eq!(p.edit_offsets, step.edit_offsets);
        assert_eq!(p.max_seq_len, step.max_seq_len);
        assert!(p.decode_only);
        assert_eq!(
            pad_to_bucket(&step, 3, 3),
            Some(step.clone()),
            "a full bucket"
        );
    }

    #[test]
    fn only_decode_steps_that_fit_are_padded() {
        let step = three();
        assert_eq!(pad_to_bucket(&step, 2, 3), None, "bucket too small");
        assert_eq!(pad_to_bucket(&step, 4, 4), None, "another table width");
        let mut b = ForwardBatch::default();
        b.push(&[1, 2], 0, vec![0, 1], vec![0], true);
        let prefill = PackedStep::pack(&b, &CAP).expect("valid");
        assert_eq!(pad_to_bucket(&prefill, 4, 3), None);
        let mut b = ForwardBatch::default();
        b.push(&[1], 0, vec![0], vec![0], false);
        b.push(&[2], 0, vec![4], vec![1], true);
        let unsampled = PackedStep::pack(&b, &CAP).expect("valid");
        assert_eq!(pad_to_bucket(&unsampled, 4, 3), None, "row 0 not sampled");
        // The executor's question before it routes a step to a graph has the same answers.
        for (s, bucket, width) in [
            (&step, 4, 3),
            (&step, 2, 3),
            (&step, 4, 4),
            (&prefill, 4, 3),
            (&unsampled, 4, 3),
        ] {
            assert_eq!(
                fits_bucket(s, bucket, width),
                pad_to_bucket(s, bucket, width).is_some()
            );
        }
    }

    #[test]
    fn the_capture_step_is_all_padding() {
        let c = capture_step(2, 3);
        assert_eq!(c.token_ids, [0, 0]);
        assert_eq!(c.slot_mapping, [-1, -1]);
        assert_eq!(c.seq_lens, [0, 0]);
        assert_eq!(c.block_tables, [0; 6]);
        assert_eq!(c.query_start_loc, [0, 1, 2]);
        assert_eq!(c.sample_rows, [0, 1]);
        assert!(c.draw_modes.is_empty() && c.decode_only);
    }

    #[test]
    fn every_bucket_reads_the_same_disjoint_aligned_places() {
        let layout = StepLayout::new(&CAP);
        let small = GraphSections::new(&layout, 1);
        let large = GraphSections::new(&layout, 8);
        for ((name, at, _), (other, at8, len8)) in small.sections.iter().zip(&large.sections) {
            assert_eq!(
                (name, at),
                (other, at8),
                "a replay reads where it was captured"
            );
            assert_eq!(at % 8, 0, "{name} is aligned for its values");
            assert!(at + len8 <= layout.total, "{name} fits the buffer");
        }
        let mut ranges: Vec<_> = large.sections.iter().map(|&(_, a, l)| (a, a + l)).collect();
        ranges.sort();
        for pair in ranges.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "sections overlap: {pair:?}");
        }
    }

    #[test]
    fn the_padded_step_lands_in_the_graph_sections() {
        let layout = StepLayout::new(&CAP);
        let padded = pad_to_bucket(&three(), 4, CAP.max_blocks_per_seq).expect("fits");
        let mut staging = vec![0xAAu8; layout.total];
        let used = layout.write(&padded, &mut staging);
        let sections = GraphSections::new(&layout, 4);
        assert_eq!(
            used,
            sections.upload_bytes(),
            "one copy covers what the graph reads"
        );
        let i32s = |name: &str| -> Vec<i32> {
            let &(_, at, len) = sections
                .sections
                .iter()
                .find(|s| s.0 == name)
                .expect("name");
            staging[at..at + len]
                .chunks_exact(4)
                .map(|c| i32::from_ne_bytes(c.try_into().expect("4")))
                .collect()
        };
        assert_eq!(i32s("token_ids"), [7, 8, 9, 0]);
        assert_eq!(i32s("positions"), [5, 2, 9, 0]);
        assert_eq!(i32s("seq_lens"), [6, 3, 10, 0]);
        assert_eq!(i32s("sample_rows"), [0, 1, 2, 3]);
        assert_eq!(i32s("block_tables").len(), 12);
        let &(_, at, len) = &sections.sections[0];
        let slots: Vec<i64> = staging[at..at + len]
            .chunks_exact(8)
            .map(|c| i64::from_ne_bytes(c.try_into().expect("8")))
            .collect();
        assert_eq!(slots, [25, 14, 9, -1]);
    }
}
