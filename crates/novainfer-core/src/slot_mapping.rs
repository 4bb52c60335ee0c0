//! Logical token position → physical KV slot, through a block table.
//!
//! ```text
//!   block_size = 4, block_table = [7, 2, 9]
//!
//!   position:     0  1  2  3 | 4  5  6  7 | 8  9  10 11
//!   block:        ----7----- | ----2----- | ----9------
//!   slot:        28 29 30 31 | 8  9 10 11 | 36 37 38 39
//!
//!   slot = block_table[pos / block_size] * block_size + pos % block_size
//! ```

use crate::ids::BlockId;

/// Slots for positions `start..start + len`. Panics if the table is too short:
/// the scheduler allocated blocks for exactly these positions, so that is a bug.
pub fn slot_mapping(
    block_table: &[BlockId],
    start: usize,
    len: usize,
    block_size: usize,
) -> Vec<usize> {
    (start..start + len)
        .map(|pos| {
            let block = block_table
                .get(pos / block_size)
                .expect("slot_mapping: position beyond the block table: this is a bug");
            block.index() * block_size + pos % block_size
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_diagram() {
        let table = [BlockId(7), BlockId(2), BlockId(9)];
        assert_eq!(slot_mapping(&table, 2, 4, 4), vec![30, 31, 8, 9]);
        assert_eq!(slot_mapping(&table, 11, 1, 4), vec![39]);
        assert_eq!(slot_mapping(&table, 0, 0, 4), Vec::<usize>::new());
    }

    #[test]
    #[should_panic(expected = "this is a bug")]
    fn a_position_past_the_table_is_a_bug() {
        slot_mapping(&[BlockId(0)], 3, 2, 4);
    }
}
