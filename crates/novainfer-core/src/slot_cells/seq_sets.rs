//! One set of sequence ids per cell, as a bitset of `max_seqs` bits (llama.cpp uses a
//! fixed `std::bitset<LLAMA_MAX_SEQ>`): membership, insert and remove are O(1), and
//! a cache sized for the scheduler's `max_num_seqs` costs `ceil(max_seqs / 64)`
//! words per cell. Each cell also counts its members, so "is this cell free" is
//! one load.

use super::SeqId;

#[derive(Debug, Clone)]
pub(super) struct SeqSets {
    words_per_cell: usize,
    /// Cell `c`'s set is `bits[c * words_per_cell..(c + 1) * words_per_cell]`.
    bits: Vec<u64>,
    len: Vec<u32>,
}

impl SeqSets {
    pub(super) fn new(num_cells: usize, max_seqs: usize) -> Self {
        let words_per_cell = max_seqs.div_ceil(64);
        Self {
            words_per_cell,
            bits: vec![0; num_cells * words_per_cell],
            len: vec![0; num_cells],
        }
    }

    pub(super) fn len(&self, cell: usize) -> usize {
        self.len[cell] as usize
    }

    pub(super) fn is_empty(&self, cell: usize) -> bool {
        self.len[cell] == 0
    }

    pub(super) fn contains(&self, cell: usize, seq: SeqId) -> bool {
        let (w, mask) = self.bit(cell, seq);
        self.bits[w] & mask != 0
    }

    /// False if `seq` was already in the set.
    pub(super) fn insert(&mut self, cell: usize, seq: SeqId) -> bool {
        let (w, mask) = self.bit(cell, seq);
        let fresh = self.bits[w] & mask == 0;
        self.bits[w] |= mask;
        self.len[cell] += u32::from(fresh);
        fresh
    }

    /// False if `seq` was not in the set.
    pub(super) fn remove(&mut self, cell: usize, seq: SeqId) -> bool {
        let (w, mask) = self.bit(cell, seq);
        let present = self.bits[w] & mask != 0;
        self.bits[w] &= !mask;
        self.len[cell] -= u32::from(present);
        present
    }

    /// The members of `cell`'s set, ascending.
    pub(super) fn ids(&self, cell: usize) -> impl Iterator<Item = SeqId> + '_ {
        let words = &self.bits[cell * self.words_per_cell..(cell + 1) * self.words_per_cell];
        words.iter().enumerate().flat_map(|(w, &word)| {
            let mut bits = word;
            std::iter::from_fn(move || {
                (bits != 0).then(|| {
                    let bit = bits.trailing_zeros();
                    bits &= bits - 1;
                    SeqId((w * 64) as u32 + bit)
                })
            })
        })
    }

    pub(super) fn clear(&mut self) {
        self.bits.fill(0);
        self.len.fill(0);
    }

    fn bit(&self, cell: usize, seq: SeqId) -> (usize, u64) {
        let s = seq.index();
        (cell * self.words_per_cell + s / 64, 1u64 << (s % 64))
    }
}
