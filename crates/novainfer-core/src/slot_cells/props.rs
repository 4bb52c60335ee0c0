//! Random operation sequences against a plain reference model: per sequence a
//! `BTreeMap<pos, cell>`, per cell a `BTreeSet` of sequences, and each rule of the
//! operations rewritten the obvious way. After every step the invariants hold and
//! every observable (cells_of, positions, seq sets, stats) equals the reference's.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

/// Seq ids straddle a word boundary of the bitsets.
const SEQS: [u32; 5] = [0, 1, 2, 63, 64];
const MAX_SEQS: usize = 65;

#[derive(Debug, Clone)]
enum Op {
    /// find_slots(n), then give `seq` the next `n` positions in those cells.
    Append {
        seq: u32,
        n: usize,
    },
    Assign {
        cell: usize,
        pos: usize,
        seq: u32,
    },
    Rm {
        seq: u32,
        p0: usize,
        len: Option<usize>,
    },
    Cp {
        src: u32,
        dst: u32,
        p0: usize,
        len: Option<usize>,
    },
    Keep {
        seq: u32,
    },
    Add {
        seq: u32,
        p0: usize,
        len: Option<usize>,
        delta: isize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let seq = || proptest::sample::select(SEQS.to_vec());
    let len = || proptest::option::of(0usize..12);
    prop_oneof![
        4 => (seq(), 0usize..6).prop_map(|(seq, n)| Op::Append { seq, n }),
        1 => (0usize..24, 0usize..20, seq()).prop_map(|(cell, pos, seq)| Op::Assign { cell, pos, seq }),
        2 => (seq(), 0usize..20, len()).prop_map(|(seq, p0, len)| Op::Rm { seq, p0, len }),
        2 => (seq(), seq(), 0usize..20, len()).prop_map(|(src, dst, p0, len)| Op::Cp { src, dst, p0, len }),
        1 => seq().prop_map(|seq| Op::Keep { seq }),
        2 => (seq(), 0usize..20, len(), -6isize..=6)
            .prop_map(|(seq, p0, len, delta)| Op::Add { seq, p0, len, delta }),
    ]
}

#[derive(Debug, Clone, PartialEq)]
struct Reference {
    seqs: BTreeMap<u32, BTreeMap<usize, usize>>,
    cells: Vec<BTreeSet<u32>>,
    pos: Vec<usize>,
}

impl Reference {
    fn new(num_cells: usize) -> Self {
        Self {
            seqs: SEQS.iter().map(|&s| (s, BTreeMap::new())).collect(),
            cells: vec![BTreeSet::new(); num_cells],
            pos: vec![0; num_cells],
        }
    }
    fn num_free(&self) -> usize {
        self.cells.iter().filter(|s| s.is_empty()).count()
    }
    fn link(&mut self, cell: usize, pos: usize, seq: u32) {
        self.cells[cell].insert(seq);
        self.pos[cell] = pos;
        self.seqs.get_mut(&seq).unwrap().insert(pos, cell);
    }
    fn in_range(p: usize, p0: usize, p1: Option<usize>) -> bool {
        p >= p0 && p1.is_none_or(|e| p < e)
    }
    fn entries(&self, seq: u32, p0: usize, p1: Option<usize>) -> Vec<(usize, usize)> {
        self.seqs[&seq]
            .iter()
            .filter(|(&p, _)| Self::in_range(p, p0, p1))
            .map(|(&p, &c)| (p, c))
            .collect()
    }
    fn unlink(&mut self, seq: u32, pos: usize) {
        let cell = self.seqs.get_mut(&seq).unwrap().remove(&pos).unwrap();
        self.cells[cell].remove(&seq);
    }

    fn assign(&mut self, cell: usize, pos: usize, seq: u32) -> bool {
        if cell >= self.cells.len() || (!self.cells[cell].is_empty() && self.pos[cell] != pos) {
            return false;
        }
        match self.seqs[&seq].get(&pos) {
            Some(&c) => c == cell,
            None => {
                self.link(cell, pos, seq);
                true
            }
        }
    }
    fn rm(&mut self, seq: u32, p0: usize, p1: Option<usize>) {
        for (p, _) in self.entries(seq, p0, p1) {
            self.unlink(seq, p);
        }
    }
    fn cp(&mut self, src: u32, dst: u32, p0: usize, p1: Option<usize>) -> bool {
        let entries = self.entries(src, p0, p1);
        if src != dst
            && entries
                .iter()
                .any(|&(p, c)| self.seqs[&dst].get(&p).is_some_and(|&d| d != c))
        {
            return false;
        }
        for (p, c) in entries {
            self.link(c, p, dst);
        }
        true
    }
    fn keep(&mut self, seq: u32) {
        for s in SEQS.into_iter().filter(|&s| s != seq) {
            self.rm(s, 0, None);
        }
    }
    /// `None` when refused; else the moved cells.
    fn add(
        &mut self,
        seq: u32,
        p0: usize,
        p1: Option<usize>,
        delta: isize,
    ) -> Option<Vec<CellShift>> {
        if delta == 0 {
            return Some(Vec::new());
        }
        let entries = self.entries(seq, p0, p1);
        for &(p, c) in &entries {
            let new = p as isize + delta;
            let collides = new >= 0
                && !Self::in_range(new as usize, p0, p1)
                && self.seqs[&seq].contains_key(&(new as usize));
            if self.cells[c].len() > 1 || collides {
                return None;
            }
        }
        for &(p, _) in &entries {
            self.unlink(seq, p);
        }
        let mut shifts = Vec::new();
        for (p, c) in entries {
            let new = p as isize + delta;
            if new >= 0 {
                self.link(c, new as usize, seq);
                shifts.push(CellShift { cell: c, delta });
            }
        }
        Some(shifts)
    }
}

fn p1_of(p0: usize, len: Option<usize>) -> Option<usize> {
    len.map(|l| p0 + l)
}

fn assert_matches(cells: &SlotCells, reference: &Reference) {
    cells.assert_invariants();
    for (&s, map) in &reference.seqs {
        let seq = SeqId(s);
        assert_eq!(
            cells.cells_of(seq),
            map.values().copied().collect::<Vec<_>>(),
            "{seq}"
        );
        assert_eq!(cells.seq_pos_max(seq), map.keys().next_back().copied());
        assert_eq!(cells.seq_pos_min(seq), map.keys().next().copied());
    }
    for (c, set) in reference.cells.iter().enumerate() {
        let expected: Vec<SeqId> = set.iter().map(|&s| SeqId(s)).collect();
        assert_eq!(cells.seq_ids(c), expected, "cell {c}");
        assert_eq!(
            cells.pos(c),
            (!set.is_empty()).then_some(reference.pos[c]),
            "cell {c}"
        );
    }
    assert_eq!(cells.num_free_cells(), reference.num_free());
    let refs: usize = reference.cells.iter().map(BTreeSet::len).sum();
    assert_eq!(cells.num_refs(), refs);
}

fn apply(cells: &mut SlotCells, reference: &mut Reference, op: &Op) {
    match *op {
        Op::Append { seq, n } => {
            let found = cells.find_slots(n);
            assert_eq!(
                found.is_some(),
                reference.num_free() >= n,
                "find_slots({n})"
            );
            let Some(slots) = found else { return };
            assert_eq!(slots.len(), n);
            assert_eq!(
                slots.iter().collect::<BTreeSet<_>>().len(),
                n,
                "distinct cells"
            );
            let start = reference.seqs[&seq].keys().next_back().map_or(0, |p| p + 1);
            for (i, &c) in slots.iter().enumerate() {
                assert!(reference.cells[c].is_empty(), "cell {c} was not free");
                assert!(reference.assign(c, start + i, seq));
                cells.assign(c, start + i, SeqId(seq)).unwrap();
            }
        }
        Op::Assign { cell, pos, seq } => {
            let ok = reference.assign(cell, pos, seq);
            assert_eq!(cells.assign(cell, pos, SeqId(seq)).is_ok(), ok);
        }
        Op::Rm { seq, p0, len } => {
            reference.rm(seq, p0, p1_of(p0, len));
            cells.seq_rm(SeqId(seq), p0, p1_of(p0, len)).unwrap();
        }
        Op::Cp { src, dst, p0, len } => {
            let ok = reference.cp(src, dst, p0, p1_of(p0, len));
            assert_eq!(
                cells
                    .seq_cp(SeqId(src), SeqId(dst), p0, p1_of(p0, len))
                    .is_ok(),
                ok
            );
        }
        Op::Keep { seq } => {
            reference.keep(seq);
            cells.seq_keep(SeqId(seq)).unwrap();
        }
        Op::Add {
            seq,
            p0,
            len,
            delta,
        } => {
            let expected = reference.add(seq, p0, p1_of(p0, len), delta);
            assert_eq!(
                cells.seq_add(SeqId(seq), p0, p1_of(p0, len), delta).ok(),
                expected
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn operations_agree_with_the_reference_and_leak_nothing(
        num_cells in 1usize..=24,
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let mut cells = SlotCells::new(num_cells, MAX_SEQS);
        let mut reference = Reference::new(num_cells);
        let mut watermark = 0;
        for op in &ops {
            apply(&mut cells, &mut reference, op);
            assert_matches(&cells, &reference);
            watermark = watermark.max(num_cells - reference.num_free());
            prop_assert_eq!(cells.watermark(), watermark);
        }
        for s in SEQS {
            cells.seq_rm(SeqId(s), 0, None).unwrap();
        }
        cells.assert_invariants();
        prop_assert_eq!(cells.num_free_cells(), num_cells);
        prop_assert_eq!(cells.num_refs(), 0);
    }
}
