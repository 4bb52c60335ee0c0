//! Exact oracles for each operation, on the scenarios llama.cpp uses cells for.

use super::*;

const S0: SeqId = SeqId(0);
const S1: SeqId = SeqId(1);
const S2: SeqId = SeqId(2);

impl SlotCells {
    /// Panics unless every invariant of the module doc holds.
    pub(super) fn assert_invariants(&self) {
        let mut refs = 0;
        let mut free = 0;
        for cell in 0..self.num_cells() {
            let seq_ids = self.seq_ids(cell);
            assert_eq!(seq_ids.len(), self.seq_sets.len(cell), "cell {cell}");
            for seq in &seq_ids {
                assert_eq!(self.seqs[seq.index()].get(&self.pos[cell]), Some(&cell));
            }
            refs += seq_ids.len();
            free += usize::from(seq_ids.is_empty());
            assert_eq!(self.pos(cell).is_none(), seq_ids.is_empty(), "cell {cell}");
        }
        for (s, map) in self.seqs.iter().enumerate() {
            for (&pos, &cell) in map {
                let seq = SeqId(s as u32);
                assert!(self.seq_sets.contains(cell, seq), "{seq} lists cell {cell}");
                assert_eq!(self.pos[cell], pos);
            }
        }
        assert_eq!(free, self.num_free);
        assert_eq!(self.num_free + self.num_used_cells(), self.num_cells());
        assert_eq!(refs, self.num_refs);
        assert!(self.watermark >= self.num_used_cells());
    }
}

/// Gives `seq` the next `n` positions in the cells `find_slots` picks; returns them.
fn append(cells: &mut SlotCells, seq: SeqId, n: usize) -> Vec<usize> {
    let start = cells.seq_pos_max(seq).map_or(0, |p| p + 1);
    let slots = cells.find_slots(n).expect("room for the batch");
    for (i, &cell) in slots.iter().enumerate() {
        cells.assign(cell, start + i, seq).unwrap();
    }
    cells.assert_invariants();
    slots
}

fn positions(cells: &SlotCells, seq: SeqId) -> Vec<usize> {
    cells
        .cells_of(seq)
        .iter()
        .map(|&c| cells.pos(c).unwrap())
        .collect()
}

#[test]
fn find_slots_prefers_a_contiguous_run_then_any_free_cells() {
    let mut cells = SlotCells::new(8, 2);
    assert_eq!(cells.find_slots(0), Some(vec![]));
    assert_eq!(append(&mut cells, S0, 3), vec![0, 1, 2]);
    assert_eq!(
        cells.find_slots(2),
        Some(vec![3, 4]),
        "find_slots takes nothing"
    );
    assert_eq!(append(&mut cells, S0, 2), vec![3, 4]);
    // A hole at cell 1 moves the head back; a run of 2 skips it, a single token fills it.
    cells.seq_rm(S0, 1, Some(2)).unwrap();
    cells.assert_invariants();
    assert_eq!(cells.find_slots(2), Some(vec![5, 6]));
    assert_eq!(cells.find_slots(1), Some(vec![1]));
    // Free: 1, 5, 6, 7. No run of 4: the free cells from the head on.
    assert_eq!(cells.find_slots(4), Some(vec![1, 5, 6, 7]));
    let before = cells.stats();
    assert_eq!(cells.find_slots(5), None);
    assert_eq!(cells.stats(), before);
    assert_eq!(cells.cells_of(S0), vec![0, 2, 3, 4]);
    assert_eq!(positions(&cells, S0), vec![0, 2, 3, 4]);
}

#[test]
fn a_run_straddling_the_head_is_found() {
    let mut cells = SlotCells::new(6, 2);
    append(&mut cells, S0, 6);
    assert_eq!(cells.find_slots(1), None);
    cells.seq_rm(S0, 2, Some(5)).unwrap();
    // Taking cell 3 moves the head to 4; freeing it again brings the head to 3,
    // inside the free run 2..5.
    cells.assign(3, 3, S0).unwrap();
    cells.seq_rm(S0, 3, Some(4)).unwrap();
    assert_eq!(cells.find_slots(3), Some(vec![2, 3, 4]));
}

#[test]
fn without_a_run_free_cells_are_taken_from_the_head_on_wrapping() {
    let mut cells = SlotCells::new(6, 2);
    append(&mut cells, S0, 5);
    cells.seq_rm(S0, 1, Some(2)).unwrap();
    cells.seq_rm(S0, 3, Some(4)).unwrap();
    cells.assign(3, 3, S0).unwrap();
    cells.seq_rm(S0, 3, Some(4)).unwrap();
    // Free: 1, 3, 5; head 3.
    assert_eq!(cells.find_slots(3), Some(vec![3, 5, 1]));
    assert_eq!(cells.find_slots(2), Some(vec![3, 5]));
}

#[test]
fn two_sequences_share_a_prompt_then_diverge() {
    let mut cells = SlotCells::new(16, 4);
    assert_eq!(append(&mut cells, S0, 4), vec![0, 1, 2, 3]);
    cells.seq_cp(S0, S1, 0, None).unwrap();
    cells.assert_invariants();
    assert_eq!(cells.cells_of(S1), vec![0, 1, 2, 3]);
    assert_eq!(cells.seq_ids(2), vec![S0, S1]);
    assert_eq!((cells.num_used_cells(), cells.num_refs()), (4, 8));
    // Each decodes its own token at position 4.
    assert_eq!(append(&mut cells, S0, 1), vec![4]);
    assert_eq!(append(&mut cells, S1, 1), vec![5]);
    assert_eq!(cells.cells_of(S0), vec![0, 1, 2, 3, 4]);
    assert_eq!(cells.cells_of(S1), vec![0, 1, 2, 3, 5]);
    assert_eq!(cells.seq_ids(4), vec![S0]);
    assert_eq!(cells.mask(S1, 2).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert_eq!(cells.mask(S1, 4).collect::<Vec<_>>(), vec![0, 1, 2, 3, 5]);
    // Dropping S0 frees only its own token; the prompt stays for S1.
    cells.seq_rm(S0, 0, None).unwrap();
    cells.assert_invariants();
    assert_eq!(cells.pos(4), None);
    assert_eq!(cells.seq_ids(0), vec![S1]);
    assert_eq!((cells.num_used_cells(), cells.num_refs()), (5, 5));
    cells.seq_rm(S1, 0, None).unwrap();
    assert_eq!(cells.stats().num_free_cells, 16);
    assert_eq!(cells.stats().watermark_cells, 6);
    assert_eq!(cells.find_slots(1), Some(vec![0]));
}

#[test]
fn one_token_of_a_batch_may_belong_to_several_sequences() {
    let mut cells = SlotCells::new(4, 2);
    cells.assign(0, 0, S0).unwrap();
    cells.assign(0, 0, S1).unwrap();
    cells.assign(0, 0, S1).unwrap();
    assert_eq!(cells.seq_ids(0), vec![S0, S1]);
    assert_eq!(cells.num_refs(), 2);
    assert_eq!(
        cells.assign(0, 1, S1),
        Err(SlotError::CellHoldsOtherPos {
            cell: 0,
            held_pos: 0,
            pos: 1
        })
    );
    assert_eq!(
        cells.assign(1, 0, S0),
        Err(SlotError::PositionTaken {
            seq: S0,
            pos: 0,
            cell: 0
        })
    );
    cells.assert_invariants();
    assert_eq!(cells.num_used_cells(), 1);
}

#[test]
fn seq_rm_of_a_suffix_rewinds() {
    let mut cells = SlotCells::new(8, 2);
    append(&mut cells, S0, 6);
    cells.seq_rm(S0, 4, Some(4)).unwrap();
    cells.seq_rm(S0, 5, Some(2)).unwrap();
    assert_eq!(cells.num_used_cells(), 6, "empty ranges remove nothing");
    cells.seq_rm(S0, 4, None).unwrap();
    cells.assert_invariants();
    assert_eq!(cells.cells_of(S0), vec![0, 1, 2, 3]);
    assert_eq!(
        (cells.seq_pos_min(S0), cells.seq_pos_max(S0)),
        (Some(0), Some(3))
    );
    // The rewound sequence regenerates into the freed cells.
    assert_eq!(append(&mut cells, S0, 2), vec![4, 5]);
    assert_eq!(positions(&cells, S0), vec![0, 1, 2, 3, 4, 5]);
}

#[test]
fn seq_keep_after_a_beam_search() {
    let mut cells = SlotCells::new(8, 3);
    append(&mut cells, S0, 3);
    cells.seq_cp(S0, S1, 0, None).unwrap();
    cells.seq_cp(S0, S2, 0, None).unwrap();
    assert_eq!(append(&mut cells, S0, 1), vec![3]);
    assert_eq!(append(&mut cells, S1, 1), vec![4]);
    assert_eq!(append(&mut cells, S2, 1), vec![5]);
    // Beam 2 cannot take beam 1's token at a position it already holds.
    assert_eq!(
        cells.seq_cp(S1, S2, 3, Some(4)),
        Err(SlotError::PositionTaken {
            seq: S2,
            pos: 3,
            cell: 5
        })
    );
    assert_eq!(cells.seq_ids(4), vec![S1]);
    cells.seq_keep(S1).unwrap();
    cells.assert_invariants();
    assert_eq!(cells.cells_of(S1), vec![0, 1, 2, 4]);
    assert_eq!(cells.seq_ids(0), vec![S1]);
    assert_eq!((cells.pos(3), cells.pos(5)), (None, None));
    assert_eq!((cells.seq_pos_max(S0), cells.seq_pos_max(S2)), (None, None));
    assert_eq!((cells.num_used_cells(), cells.num_refs()), (4, 4));
    assert_eq!(cells.find_slots(2), Some(vec![5, 6]));
}

#[test]
fn seq_add_shifts_the_context_window() {
    let mut cells = SlotCells::new(10, 2);
    append(&mut cells, S0, 8);
    // Keep 2 tokens, discard the next 3, shift the rest back (llama.cpp's context shift).
    cells.seq_rm(S0, 2, Some(5)).unwrap();
    let shifts = cells.seq_add(S0, 5, None, -3).unwrap();
    cells.assert_invariants();
    let expected: Vec<_> = [5, 6, 7].map(|cell| CellShift { cell, delta: -3 }).to_vec();
    assert_eq!(shifts, expected);
    assert_eq!(cells.cells_of(S0), vec![0, 1, 5, 6, 7]);
    assert_eq!(positions(&cells, S0), vec![0, 1, 2, 3, 4]);
    assert_eq!(cells.seq_pos_max(S0), Some(4));
    // A forward shift inside the sequence: no collision, since 2..5 moves as a whole.
    assert_eq!(cells.seq_add(S0, 2, None, 1).unwrap().len(), 3);
    assert_eq!(positions(&cells, S0), vec![0, 1, 3, 4, 5]);
    assert_eq!(cells.seq_add(S0, 0, None, 0), Ok(vec![]));
}

#[test]
fn seq_add_refuses_shared_cells_and_collisions() {
    let mut cells = SlotCells::new(10, 2);
    append(&mut cells, S0, 5);
    cells.seq_cp(S0, S1, 0, Some(2)).unwrap();
    let before = (cells.cells_of(S0), positions(&cells, S0), cells.stats());
    assert_eq!(
        cells.seq_add(S0, 0, None, 1),
        Err(SlotError::SharedCell {
            seq: S0,
            cell: 0,
            other: S1
        })
    );
    assert_eq!(
        cells.seq_add(S0, 3, None, -2),
        Err(SlotError::PositionTaken {
            seq: S0,
            pos: 1,
            cell: 1
        })
    );
    assert_eq!(
        (cells.cells_of(S0), positions(&cells, S0), cells.stats()),
        before
    );
    cells.assert_invariants();
}

#[test]
fn seq_add_below_zero_removes_and_past_usize_max_is_an_error() {
    let mut cells = SlotCells::new(4, 1);
    append(&mut cells, S0, 3);
    let shifts = cells.seq_add(S0, 0, None, -1).unwrap();
    cells.assert_invariants();
    assert_eq!(
        shifts,
        vec![
            CellShift { cell: 1, delta: -1 },
            CellShift { cell: 2, delta: -1 }
        ]
    );
    assert_eq!(cells.cells_of(S0), vec![1, 2]);
    assert_eq!(positions(&cells, S0), vec![0, 1]);
    assert_eq!(cells.pos(0), None);
    cells.assign(3, usize::MAX - 1, S0).unwrap();
    assert_eq!(
        cells.seq_add(S0, 2, None, 5),
        Err(SlotError::PositionOverflow {
            seq: S0,
            pos: usize::MAX - 1,
            delta: 5
        })
    );
}

#[test]
fn out_of_range_ids_are_errors_and_read_as_empty() {
    let mut cells = SlotCells::new(2, 4);
    let far = SeqId(4);
    let err = SlotError::SeqOutOfRange {
        seq: far,
        max_seqs: 4,
    };
    assert_eq!(cells.assign(0, 0, far), Err(err.clone()));
    assert_eq!(cells.seq_rm(far, 0, None), Err(err.clone()));
    assert_eq!(cells.seq_cp(S0, far, 0, None), Err(err.clone()));
    assert_eq!(cells.seq_keep(far), Err(err.clone()));
    assert_eq!(cells.seq_add(far, 0, None, 1), Err(err));
    assert_eq!(
        cells.assign(2, 0, S0),
        Err(SlotError::CellOutOfRange {
            cell: 2,
            num_cells: 2
        })
    );
    assert_eq!(cells.cells_of(far), Vec::<usize>::new());
    assert_eq!(cells.seq_pos_max(far), None);
    assert_eq!(cells.num_used_cells(), 0);
}

#[test]
fn sequence_sets_span_several_words() {
    let mut cells = SlotCells::new(3, 130);
    let high = SeqId(129);
    cells.assign(1, 0, SeqId(64)).unwrap();
    cells.assign(1, 0, high).unwrap();
    cells.assign(1, 0, S0).unwrap();
    assert_eq!(cells.seq_ids(1), vec![S0, SeqId(64), high]);
    cells.seq_keep(high).unwrap();
    cells.assert_invariants();
    assert_eq!(cells.seq_ids(1), vec![high]);
    cells.clear();
    cells.assert_invariants();
    assert_eq!((cells.num_free_cells(), cells.num_refs()), (3, 0));
    assert_eq!(cells.watermark(), 1);
}
