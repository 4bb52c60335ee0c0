//! Host-side checks of one step's device inputs, before they are uploaded.
//!
//! The launchers check lengths, but values that live on the device — token ids, positions,
//! slots, block ids — are read only by the kernels, which stay defensive (a zero row, an
//! unrotated head, a masked key) but cannot report anything. A defensive kernel turns a
//! runner bug into a silently wrong token, so the runner calls [`validate_step`] on the host
//! copies and gets an error naming the field and the index instead.

use crate::error::{CudaError, Result};

/// The sizes the step's values must fit in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLimits {
    /// Rows of the embedding table.
    pub vocab_size: usize,
    /// Rows of the RoPE table (`RopeTable::max_positions`).
    pub rope_positions: usize,
    /// `num_blocks · block_size` of the KV pool.
    pub num_slots: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    /// Row length of `block_tables`.
    pub max_blocks_per_seq: usize,
}

/// Host copies of what the step uploads (lengths as the launchers take them).
#[derive(Debug, Clone, Copy)]
pub struct StepInputs<'a> {
    pub token_ids: &'a [u32],
    pub positions: &'a [i32],
    /// Negative: a padding token that writes nothing.
    pub slot_mapping: &'a [i64],
    /// `[num_seqs, max_blocks_per_seq]`, row-major.
    pub block_tables: &'a [i32],
    pub seq_lens: &'a [i32],
}

/// Checks every value against `limits`; the first bad one is an
/// [`CudaError::InvalidArgument`] naming the field, the index and the limit.
pub fn validate_step(limits: &StepLimits, step: &StepInputs<'_>) -> Result<()> {
    let num_tokens = step.token_ids.len();
    for (param, len) in [
        ("positions", step.positions.len()),
        ("slot_mapping", step.slot_mapping.len()),
    ] {
        if len != num_tokens {
            return Err(CudaError::invalid(
                param,
                format!("{len} entries for {num_tokens} tokens"),
            ));
        }
    }
    if let Some((i, id)) = first(step.token_ids, |&id| id as usize >= limits.vocab_size) {
        return Err(bad(
            "token_ids",
            i,
            id,
            format!("vocabulary of {}", limits.vocab_size),
        ));
    }
    if let Some((i, p)) = first(step.positions, |&p| {
        p < 0 || p as usize >= limits.rope_positions
    }) {
        return Err(bad(
            "positions",
            i,
            p,
            format!("RoPE table of {} positions", limits.rope_positions),
        ));
    }
    if let Some((i, s)) = first(step.slot_mapping, |&s| {
        s >= 0 && s as u64 >= limits.num_slots as u64
    }) {
        return Err(bad(
            "slot_mapping",
            i,
            s,
            format!("pool of {} slots", limits.num_slots),
        ));
    }
    validate_tables(limits, step.block_tables, step.seq_lens)
}

/// Every block a sequence's history reaches lies in the pool, and the history fits its row.
fn validate_tables(limits: &StepLimits, block_tables: &[i32], seq_lens: &[i32]) -> Result<()> {
    let width = limits.max_blocks_per_seq;
    if block_tables.len() != seq_lens.len() * width {
        return Err(CudaError::invalid(
            "block_tables",
            format!(
                "{} entries for {} sequences of {width} blocks",
                block_tables.len(),
                seq_lens.len()
            ),
        ));
    }
    let capacity = width * limits.block_size;
    for (s, &len) in seq_lens.iter().enumerate() {
        if len < 0 || len as usize > capacity {
            return Err(bad(
                "seq_lens",
                s,
                len,
                format!("{width} blocks of {} positions", limits.block_size),
            ));
        }
        let used = (len as usize).div_ceil(limits.block_size.max(1));
        let row = &block_tables[s * width..s * width + used];
        if let Some((b, id)) = first(row, |&id| id < 0 || id as usize >= limits.num_blocks) {
            return Err(CudaError::invalid(
                "block_tables",
                format!(
                    "sequence {s}, entry {b}: block {id} outside a pool of {} blocks",
                    limits.num_blocks
                ),
            ));
        }
    }
    Ok(())
}

fn first<T: Copy>(values: &[T], is_bad: impl Fn(&T) -> bool) -> Option<(usize, T)> {
    values.iter().position(&is_bad).map(|i| (i, values[i]))
}

fn bad(
    param: &'static str,
    index: usize,
    value: impl std::fmt::Display,
    limit: String,
) -> CudaError {
    CudaError::invalid(
        param,
        format!("entry {index} is {value}, outside the {limit}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: StepLimits = StepLimits {
        vocab_size: 100,
        rope_positions: 64,
        num_slots: 8 * 4,
        num_blocks: 8,
        block_size: 4,
        max_blocks_per_seq: 3,
    };

    struct Step {
        ids: Vec<u32>,
        pos: Vec<i32>,
        slots: Vec<i64>,
        tables: Vec<i32>,
        lens: Vec<i32>,
    }

    impl Step {
        /// Two sequences: 5 positions in blocks 7, 2; one padding token (slot -1).
        fn good() -> Self {
            Self {
                ids: vec![1, 99, 0],
                pos: vec![4, 0, 0],
                slots: vec![2 * 4, 3 * 4, -1],
                tables: vec![7, 2, -1, 3, -1, -1],
                lens: vec![5, 1],
            }
        }
        fn check(&self) -> Result<()> {
            validate_step(
                &LIMITS,
                &StepInputs {
                    token_ids: &self.ids,
                    positions: &self.pos,
                    slot_mapping: &self.slots,
                    block_tables: &self.tables,
                    seq_lens: &self.lens,
                },
            )
        }
    }

    fn param(r: Result<()>) -> &'static str {
        match r {
            Err(CudaError::InvalidArgument { param, .. }) => param,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn a_good_step_passes_and_unused_table_entries_are_ignored() {
        Step::good().check().expect("valid");
    }

    #[test]
    fn each_bad_value_is_named() {
        let mut s = Step::good();
        s.ids[1] = 100;
        assert_eq!(param(s.check()), "token_ids");
        let mut s = Step::good();
        s.pos[0] = 64;
        assert_eq!(param(s.check()), "positions");
        let mut s = Step::good();
        s.pos[2] = -1;
        assert_eq!(param(s.check()), "positions");
        let mut s = Step::good();
        s.slots[0] = 32;
        assert_eq!(param(s.check()), "slot_mapping");
        let mut s = Step::good();
        s.tables[1] = 8;
        assert_eq!(param(s.check()), "block_tables");
        let mut s = Step::good();
        s.lens[1] = 13; // 3 blocks of 4 hold 12
        assert_eq!(param(s.check()), "seq_lens");
        let mut s = Step::good();
        s.lens[1] = 5; // reaches the second entry of its row, which is -1
        assert_eq!(param(s.check()), "block_tables");
        let mut s = Step::good();
        s.slots.pop();
        assert_eq!(param(s.check()), "slot_mapping");
    }
}
