//! The SLOT KV layout's bookkeeping: llama.cpp-style cells (DESIGN.md §3).
//!
//! The cache is a fixed array of `num_cells` cells; a cell is either free or holds
//! one token's K/V at a position `pos`, seen by a set of sequences. Sharing a cell
//! between sequences is how a common prompt is reused ([`SlotCells::seq_cp`]):
//! nothing is copied, the cell just lists one more sequence. Like the block pool,
//! this only counts; the bytes live in the model's KV tensors, indexed by cell.
//!
//! ```text
//!   cell:     0      1      2      3      4      5
//!   pos:      0      1      2      2      -      3
//!   seq_ids: {0,1}  {0,1}  {0}    {1}    {}     {1}
//!
//!   cells_of(0) = [0, 1, 2]      cells_of(1) = [0, 1, 3, 5]      cell 4 is free
//! ```
//!
//! Invariants (checked after every step of the tests and the proptest):
//! - a cell is free iff its set of sequences is empty;
//! - a sequence holds at most one cell per position, and a cell lists `seq` iff
//!   `seq`'s position map sends that cell's `pos` to that cell;
//! - `num_free_cells() + num_used_cells() == num_cells()`;
//! - `num_refs()` is the number of (cell, sequence) pairs.
//!
//! Sequence sets are bitsets of `max_seqs` bits per cell (see `seq_sets.rs`).
//! Beside them each sequence keeps a `BTreeMap<pos, cell>`, so
//! `cells_of`, `seq_pos_max` and the range operations never scan all cells.
//!
//! Shifting shared cells: llama.cpp's `seq_add` moves a cell for every sequence
//! that sees it, silently changing other sequences' history. Here
//! [`SlotCells::seq_add`] refuses (an error, nothing changed) when a cell in the
//! range is shared, or when a shifted position would land on a position the
//! sequence already holds outside the range. Splitting the cell instead would
//! need a free cell and a byte copy on the model side, which is an allocation
//! `seq_add` has no business making; a caller that needs it can `seq_rm` the
//! shared range and recompute it.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Bound;

use seq_sets::SeqSets;

mod seq_sets;

/// One sequence of the SLOT cache: `0..max_seqs`. The caller maps requests to seq
/// ids (and recycles them), exactly as llama.cpp's server does with its slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

impl SeqId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq-{}", self.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    #[error("{seq} is out of range: this cache holds seq ids 0..{max_seqs}")]
    SeqOutOfRange { seq: SeqId, max_seqs: usize },
    #[error("cell {cell} is out of range: the cache has {num_cells} cells")]
    CellOutOfRange { cell: usize, num_cells: usize },
    #[error("cell {cell} holds position {held_pos}; it cannot also hold position {pos}")]
    CellHoldsOtherPos {
        cell: usize,
        held_pos: usize,
        pos: usize,
    },
    #[error("{seq} already holds position {pos} in cell {cell}")]
    PositionTaken { seq: SeqId, pos: usize, cell: usize },
    #[error("seq_add: cell {cell} of {seq} is shared with {other}; shifting it would move {other}'s token too")]
    SharedCell {
        seq: SeqId,
        cell: usize,
        other: SeqId,
    },
    #[error("seq_add: position {pos} of {seq} shifted by {delta} overflows")]
    PositionOverflow {
        seq: SeqId,
        pos: usize,
        delta: isize,
    },
}

/// A cell whose position [`SlotCells::seq_add`] moved by `delta`: its cached key was
/// rotated for the old position, so the model must rotate it by `delta` more (RoPE
/// rotations add up) before attention reads it again — llama.cpp's "K-shift".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellShift {
    pub cell: usize,
    pub delta: isize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotStats {
    pub num_cells: usize,
    pub num_used_cells: usize,
    pub num_free_cells: usize,
    /// Most cells ever in use at once.
    pub watermark_cells: usize,
    /// (cell, sequence) pairs: more than `num_used_cells` when cells are shared.
    pub num_refs: usize,
}

#[derive(Debug, Clone)]
pub struct SlotCells {
    max_seqs: usize,
    /// Meaningful only while the cell is used.
    pos: Vec<usize>,
    seq_sets: SeqSets,
    /// Per sequence: position → cell.
    seqs: Vec<BTreeMap<usize, usize>>,
    num_free: usize,
    num_refs: usize,
    watermark: usize,
    /// Where [`find_slots`](Self::find_slots) starts looking: just past the last
    /// assigned cell, or the lowest cell freed since (as llama.cpp's `head`).
    head: usize,
}

impl SlotCells {
    /// `num_cells` free cells for sequences `0..max_seqs`.
    pub fn new(num_cells: usize, max_seqs: usize) -> Self {
        assert!(
            max_seqs > 0,
            "slot cells: max_seqs must be >= 1: this is a bug"
        );
        Self {
            max_seqs,
            pos: vec![0; num_cells],
            seq_sets: SeqSets::new(num_cells, max_seqs),
            seqs: vec![BTreeMap::new(); max_seqs],
            num_free: num_cells,
            num_refs: 0,
            watermark: 0,
            head: 0,
        }
    }

    pub fn num_cells(&self) -> usize {
        self.pos.len()
    }
    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }
    pub fn num_free_cells(&self) -> usize {
        self.num_free
    }
    pub fn num_used_cells(&self) -> usize {
        self.num_cells() - self.num_free
    }
    pub fn num_refs(&self) -> usize {
        self.num_refs
    }
    pub fn watermark(&self) -> usize {
        self.watermark
    }

    pub fn stats(&self) -> SlotStats {
        SlotStats {
            num_cells: self.num_cells(),
            num_used_cells: self.num_used_cells(),
            num_free_cells: self.num_free,
            watermark_cells: self.watermark,
            num_refs: self.num_refs,
        }
    }

    /// The position `cell` holds, `None` if it is free. Panics if `cell` is out of range.
    pub fn pos(&self, cell: usize) -> Option<usize> {
        (!self.seq_sets.is_empty(cell)).then_some(self.pos[cell])
    }

    /// The sequences that see `cell`, ascending. Panics if `cell` is out of range.
    pub fn seq_ids(&self, cell: usize) -> Vec<SeqId> {
        self.seq_sets.ids(cell).collect()
    }

    /// `n` free cells for a batch of new tokens, without taking them: the first run
    /// of `n` contiguous free cells at or after `head` (then before it), else the
    /// first `n` free cells from `head` on, wrapping. `None` if fewer than `n` are free.
    ///
    /// Contiguity is only a preference: a contiguous run lets the model write a
    /// chunk's K/V with one copy, but any free cells are correct.
    pub fn find_slots(&self, n: usize) -> Option<Vec<usize>> {
        if n > self.num_free {
            return None;
        }
        let num_cells = self.num_cells();
        let head = self.head.min(num_cells);
        // The second scan reaches past `head` so a run straddling it is found too.
        let run = self
            .first_free_run(head, num_cells, n)
            .or_else(|| self.first_free_run(0, (head + n).saturating_sub(1).min(num_cells), n));
        if let Some(start) = run {
            return Some((start..start + n).collect());
        }
        let cells = (head..num_cells)
            .chain(0..head)
            .filter(|&c| self.seq_sets.is_empty(c))
            .take(n)
            .collect();
        Some(cells)
    }

    /// Records that `cell` holds `seq`'s token at `pos`. The cell must be free or
    /// already hold `pos` (one token shared by several sequences of a batch), and
    /// `seq` must not hold `pos` elsewhere. Assigning the same pair twice is a no-op.
    pub fn assign(&mut self, cell: usize, pos: usize, seq: SeqId) -> Result<(), SlotError> {
        self.check_seq(seq)?;
        if cell >= self.num_cells() {
            return Err(SlotError::CellOutOfRange {
                cell,
                num_cells: self.num_cells(),
            });
        }
        if let Some(held_pos) = self.pos(cell).filter(|&p| p != pos) {
            return Err(SlotError::CellHoldsOtherPos {
                cell,
                held_pos,
                pos,
            });
        }
        match self.seqs[seq.index()].get(&pos) {
            Some(&c) if c == cell => return Ok(()),
            Some(&c) => return Err(SlotError::PositionTaken { seq, pos, cell: c }),
            None => {}
        }
        self.link(cell, pos, seq);
        self.head = if cell + 1 == self.num_cells() {
            0
        } else {
            cell + 1
        };
        Ok(())
    }

    /// Removes `seq` from its cells with `pos` in `[p0, p1)` (`p1 = None`: no end);
    /// a cell left with no sequence becomes free. Used to rewind a sequence or drop it.
    pub fn seq_rm(&mut self, seq: SeqId, p0: usize, p1: Option<usize>) -> Result<(), SlotError> {
        self.check_seq(seq)?;
        for (pos, cell) in self.entries_in(seq, p0, p1) {
            self.seqs[seq.index()].remove(&pos);
            self.unlink(cell, seq);
        }
        Ok(())
    }

    /// Lets `dst` see `src`'s cells with `pos` in `[p0, p1)`: shared, not copied.
    /// Refused, with nothing changed, if `dst` holds one of those positions in
    /// another cell (llama.cpp would leave `dst` with two tokens at one position).
    pub fn seq_cp(
        &mut self,
        src: SeqId,
        dst: SeqId,
        p0: usize,
        p1: Option<usize>,
    ) -> Result<(), SlotError> {
        self.check_seq(src)?;
        self.check_seq(dst)?;
        if src == dst {
            return Ok(());
        }
        let entries = self.entries_in(src, p0, p1);
        for &(pos, cell) in &entries {
            match self.seqs[dst.index()].get(&pos) {
                Some(&c) if c != cell => {
                    return Err(SlotError::PositionTaken {
                        seq: dst,
                        pos,
                        cell: c,
                    })
                }
                _ => {}
            }
        }
        for (pos, cell) in entries {
            if !self.seq_sets.contains(cell, dst) {
                self.link(cell, pos, dst);
            }
        }
        Ok(())
    }

    /// Drops every sequence but `seq` from every cell (after a beam search picked `seq`).
    pub fn seq_keep(&mut self, seq: SeqId) -> Result<(), SlotError> {
        self.check_seq(seq)?;
        for other in 0..self.max_seqs {
            if other == seq.index() {
                continue;
            }
            let other_seq = SeqId(other as u32);
            for (_, cell) in std::mem::take(&mut self.seqs[other]) {
                self.unlink(cell, other_seq);
            }
        }
        Ok(())
    }

    /// Shifts the positions of `seq`'s cells with `pos` in `[p0, p1)` by `delta`
    /// (llama.cpp's context shift: `seq_rm` a window, then `seq_add` the rest back).
    /// A cell whose position would fall below 0 is removed, as in llama.cpp.
    /// Returns the moved cells, whose keys the model must re-rotate.
    ///
    /// Refused, with nothing changed, if a cell in the range is shared with another
    /// sequence (see the module doc) or if a shifted position lands on one that
    /// `seq` holds outside the range.
    pub fn seq_add(
        &mut self,
        seq: SeqId,
        p0: usize,
        p1: Option<usize>,
        delta: isize,
    ) -> Result<Vec<CellShift>, SlotError> {
        self.check_seq(seq)?;
        if delta == 0 {
            return Ok(Vec::new());
        }
        let entries = self.entries_in(seq, p0, p1);
        let in_range = |p: usize| p >= p0 && p1.is_none_or(|end| p < end);
        let mut moves = Vec::with_capacity(entries.len());
        for &(pos, cell) in &entries {
            if let Some(other) = self.seq_sets.ids(cell).find(|&s| s != seq) {
                return Err(SlotError::SharedCell { seq, cell, other });
            }
            let new_pos = match pos.checked_add_signed(delta) {
                Some(p) => Some(p),
                None if delta < 0 => None,
                None => return Err(SlotError::PositionOverflow { seq, pos, delta }),
            };
            if let Some(q) = new_pos.filter(|&q| !in_range(q)) {
                if let Some(&c) = self.seqs[seq.index()].get(&q) {
                    return Err(SlotError::PositionTaken {
                        seq,
                        pos: q,
                        cell: c,
                    });
                }
            }
            moves.push((pos, cell, new_pos));
        }
        // Remove every moved entry before reinserting, so a shift inside the range
        // never overwrites an entry that has yet to move.
        for &(pos, _, _) in &moves {
            self.seqs[seq.index()].remove(&pos);
        }
        let mut shifts = Vec::with_capacity(moves.len());
        for (_, cell, new_pos) in moves {
            match new_pos {
                Some(q) => {
                    self.pos[cell] = q;
                    self.seqs[seq.index()].insert(q, cell);
                    shifts.push(CellShift { cell, delta });
                }
                None => self.unlink(cell, seq),
            }
        }
        Ok(shifts)
    }

    /// The lowest position `seq` holds; `None` if it holds none (or is out of range).
    pub fn seq_pos_min(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(seq.index())?.keys().next().copied()
    }

    /// The highest position `seq` holds; `None` if it holds none (or is out of range).
    pub fn seq_pos_max(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(seq.index())?.keys().next_back().copied()
    }

    /// `seq`'s cells in position order: its history as a block table of block size 1.
    ///
    /// After a `seq_rm` inside the history, positions have gaps and entry `i` is no
    /// longer position `i`: a reader that masks by index must take its context
    /// length from [`mask`](Self::mask)`(seq, query_pos).count()`, not from `query_pos`.
    pub fn cells_of(&self, seq: SeqId) -> Vec<usize> {
        self.mask(seq, usize::MAX).collect()
    }

    /// The cells `seq` may attend to from `query_pos`: its cells with `pos <= query_pos`,
    /// in position order.
    pub fn mask(&self, seq: SeqId, query_pos: usize) -> impl Iterator<Item = usize> + '_ {
        self.seqs
            .get(seq.index())
            .into_iter()
            .flat_map(move |m| m.range(..=query_pos).map(|(_, &cell)| cell))
    }

    /// Frees every cell (the watermark is kept: it is a high-water mark over the cache's life).
    pub fn clear(&mut self) {
        self.seq_sets.clear();
        self.seqs.iter_mut().for_each(BTreeMap::clear);
        self.num_free = self.num_cells();
        self.num_refs = 0;
        self.head = 0;
    }

    fn check_seq(&self, seq: SeqId) -> Result<(), SlotError> {
        if seq.index() < self.max_seqs {
            Ok(())
        } else {
            Err(SlotError::SeqOutOfRange {
                seq,
                max_seqs: self.max_seqs,
            })
        }
    }

    /// `(pos, cell)` of `seq` with `pos` in `[p0, p1)`, ascending; empty if `p1 <= p0`.
    fn entries_in(&self, seq: SeqId, p0: usize, p1: Option<usize>) -> Vec<(usize, usize)> {
        let end = match p1 {
            Some(p1) if p1 <= p0 => return Vec::new(),
            Some(p1) => Bound::Excluded(p1),
            None => Bound::Unbounded,
        };
        self.seqs[seq.index()]
            .range((Bound::Included(p0), end))
            .map(|(&pos, &cell)| (pos, cell))
            .collect()
    }

    fn first_free_run(&self, from: usize, to: usize, n: usize) -> Option<usize> {
        if n == 0 {
            return Some(from);
        }
        let mut run = 0;
        for c in from..to {
            run = if self.seq_sets.is_empty(c) {
                run + 1
            } else {
                0
            };
            if run == n {
                return Some(c + 1 - n);
            }
        }
        None
    }

    /// Adds `seq` to `cell` at `pos`; the caller checked that this breaks no invariant.
    fn link(&mut self, cell: usize, pos: usize, seq: SeqId) {
        let fresh = self.seq_sets.insert(cell, seq);
        debug_assert!(fresh, "slot cells: linking twice");
        if self.seq_sets.len(cell) == 1 {
            self.num_free -= 1;
            self.watermark = self.watermark.max(self.num_used_cells());
        }
        self.pos[cell] = pos;
        self.num_refs += 1;
        self.seqs[seq.index()].insert(pos, cell);
    }

    /// Removes `seq` from `cell`'s set (its position map entry is the caller's job).
    fn unlink(&mut self, cell: usize, seq: SeqId) {
        assert!(
            self.seq_sets.remove(cell, seq),
            "slot cells: {seq} is not in cell {cell}: this is a bug"
        );
        self.num_refs -= 1;
        if self.seq_sets.is_empty(cell) {
            self.num_free += 1;
            self.head = self.head.min(cell);
        }
    }
}

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
