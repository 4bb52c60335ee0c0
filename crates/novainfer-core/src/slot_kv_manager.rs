//! The SLOT KV layout behind the scheduler's [`KvManager`] contract.
//!
//! Each request holding KV owns one [`SeqId`] of a [`SlotCells`] (ids are
//! recycled, llama.cpp-server style); allocating `n` tokens is `find_slots(n)`
//! plus `assign` at the request's next positions, freeing is `seq_rm(seq, 0, ..)`.
//! A request's table is its cells in position order as [`BlockId`]s with a
//! block size of 1, so the model's slot mapping is the cell index itself.
//!
//! Invariants: `tables[r]` equals `cells.cells_of(seq_of[r])` (checked in debug
//! builds after every allocation); a seq id is either free or owned by exactly
//! one request. No prefix caching (`lookup_prefix` is always empty); the only
//! sharing is `fork` (`n > 1`), which is `seq_cp` of the parent's computed
//! positions: the child's cells are the parent's, held by both seq ids, and a
//! cell is free again once the last seq holding it is removed.

use std::collections::HashMap;

use crate::ids::{BlockId, RequestId};
use crate::kv_cache_manager::{BlockCopy, KvCacheStats, NewBlocks, PrefixHit};
use crate::kv_manager::KvManager;
use crate::request::Request;
use crate::slot_cells::{SeqId, SlotCells};

#[derive(Debug, Clone)]
struct SeqTable {
    seq: SeqId,
    cells: Vec<BlockId>,
}

#[derive(Debug, Clone)]
pub struct SlotKvManager {
    cells: SlotCells,
    tables: HashMap<RequestId, SeqTable>,
    /// Seq ids no request holds; popped from the back, so the lowest is reused first.
    free_seqs: Vec<SeqId>,
}

impl SlotKvManager {
    /// `num_cells` cells shared by at most `max_seqs` requests at once.
    pub fn new(num_cells: usize, max_seqs: usize) -> Self {
        assert!(
            u32::try_from(num_cells).is_ok() && u32::try_from(max_seqs).is_ok(),
            "slot kv: sizes must fit u32: this is a bug"
        );
        Self {
            cells: SlotCells::new(num_cells, max_seqs),
            tables: HashMap::new(),
            free_seqs: (0..max_seqs as u32).rev().map(SeqId).collect(),
        }
    }

    pub fn cells(&self) -> &SlotCells {
        &self.cells
    }

    /// The seq id request `id` holds, if it holds KV.
    pub fn seq_of(&self, id: RequestId) -> Option<SeqId> {
        self.tables.get(&id).map(|t| t.seq)
    }
}

impl KvManager for SlotKvManager {
    fn block_size(&self) -> usize {
        1
    }

    fn lookup_prefix(&self, _request: &Request) -> PrefixHit {
        PrefixHit::none()
    }

    fn allocate_slots(
        &mut self,
        request: &Request,
        num_new_tokens: usize,
        prefix_hit: &PrefixHit,
    ) -> Option<NewBlocks> {
        debug_assert!(
            prefix_hit.blocks.is_empty(),
            "slot kv: a prefix hit without prefix caching: this is a bug"
        );
        let num_held = self.tables.get(&request.id).map_or(0, |t| t.cells.len());
        let num_tokens = request.num_computed_tokens + num_new_tokens;
        let num_needed = num_tokens.saturating_sub(num_held);
        if !self.tables.contains_key(&request.id) && self.free_seqs.is_empty() {
            return None;
        }
        let cells = self.cells.find_slots(num_needed)?;
        if !self.tables.contains_key(&request.id) {
            let seq = self.free_seqs.pop().expect("checked above: this is a bug");
            let cells = Vec::new();
            self.tables.insert(request.id, SeqTable { seq, cells });
        }
        let table = self
            .tables
            .get_mut(&request.id)
            .expect("inserted above: this is a bug");
        let mut new = Vec::with_capacity(cells.len());
        for (i, &cell) in cells.iter().enumerate() {
            self.cells
                .assign(cell, num_held + i, table.seq)
                .expect("slot kv: find_slots gave a free cell for a new position: this is a bug");
            let block = BlockId(cell as u32);
            table.cells.push(block);
            new.push(block);
        }
        debug_assert_eq!(
            table.cells,
            self.cells
                .cells_of(table.seq)
                .into_iter()
                .map(|c| BlockId(c as u32))
                .collect::<Vec<_>>()
        );
        Some(NewBlocks { block_ids: new })
    }

    fn cache_full_blocks(&mut self, _request: &Request) {}

    fn fork(&mut self, parent: &Request, child: RequestId) -> Option<Option<BlockCopy>> {
        assert!(
            !self.tables.contains_key(&child),
            "fork: child {child} already holds cells: this is a bug"
        );
        let parent_table = self.tables.get(&parent.id)?;
        let (parent_seq, num_shared) = (parent_table.seq, parent.num_computed_tokens);
        let cells = parent_table.cells[..num_shared].to_vec();
        let seq = self.free_seqs.pop()?;
        self.cells
            .seq_cp(parent_seq, seq, 0, Some(num_shared))
            .expect("slot kv: a fresh seq id holds no position: this is a bug");
        self.tables.insert(child, SeqTable { seq, cells });
        Some(None)
    }

    fn free(&mut self, request_id: RequestId) -> bool {
        let Some(table) = self.tables.remove(&request_id) else {
            return false;
        };
        self.cells
            .seq_rm(table.seq, 0, None)
            .expect("slot kv: a held seq id is in range: this is a bug");
        self.free_seqs.push(table.seq);
        true
    }

    fn block_table(&self, request_id: RequestId) -> &[BlockId] {
        self.tables
            .get(&request_id)
            .map_or(&[][..], |t| t.cells.as_slice())
    }

    fn block_tables(&self) -> Vec<(RequestId, &[BlockId])> {
        self.tables
            .iter()
            .map(|(&id, t)| (id, t.cells.as_slice()))
            .collect()
    }

    fn ref_count(&self, block: BlockId) -> u32 {
        self.cells.seq_ids(block.index()).len() as u32
    }

    fn stats(&self) -> KvCacheStats {
        let s = self.cells.stats();
        KvCacheStats {
            num_blocks: s.num_cells,
            num_used_blocks: s.num_used_cells,
            num_free_blocks: s.num_free_cells,
            watermark_blocks: s.watermark_cells,
            ..KvCacheStats::default()
        }
    }

    fn reset_prefix_cache(&mut self) -> bool {
        self.cells.num_used_cells() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&b| BlockId(b)).collect()
    }

    fn grow(kv: &mut SlotKvManager, r: &mut Request, n: usize) -> Option<Vec<BlockId>> {
        let new = kv.allocate_slots(r, n, &PrefixHit::none())?;
        r.num_computed_tokens += n;
        Some(new.block_ids)
    }

    #[test]
    fn a_request_gets_one_cell_per_token_in_position_order() {
        let mut kv = SlotKvManager::new(8, 2);
        let mut a = Request::new(RequestId(1), vec![1, 2, 3], 4);
        assert_eq!(grow(&mut kv, &mut a, 3).unwrap(), ids(&[0, 1, 2]));
        assert_eq!(grow(&mut kv, &mut a, 1).unwrap(), ids(&[3]));
        assert_eq!(kv.block_table(a.id), ids(&[0, 1, 2, 3]));
        assert_eq!(kv.seq_of(a.id), Some(SeqId(0)));
        assert_eq!(kv.cells().pos(3), Some(3));
        let s = kv.stats();
        assert_eq!(
            (s.num_blocks, s.num_used_blocks, s.num_free_blocks),
            (8, 4, 4)
        );
    }

    #[test]
    fn a_freed_hole_is_reused_and_the_table_follows_positions_not_cells() {
        let mut kv = SlotKvManager::new(6, 3);
        let mut a = Request::new(RequestId(1), vec![1, 2], 4);
        let mut b = Request::new(RequestId(2), vec![1, 2], 4);
        let mut c = Request::new(RequestId(3), vec![1, 2], 4);
        grow(&mut kv, &mut a, 2).unwrap();
        grow(&mut kv, &mut b, 2).unwrap();
        grow(&mut kv, &mut c, 2).unwrap();
        assert!(kv.free(b.id));
        assert_eq!(kv.stats().watermark_blocks, 6);
        // Cells 2 and 3 are free again; `a` grows into them.
        grow(&mut kv, &mut a, 2).unwrap();
        assert_eq!(kv.block_table(a.id), ids(&[0, 1, 2, 3]));
        assert_eq!(kv.ref_count(BlockId(2)), 1);
        // The table is position order even when cells are not contiguous.
        assert!(kv.free(c.id));
        let mut d = Request::new(RequestId(4), vec![1], 4);
        grow(&mut kv, &mut d, 1).unwrap();
        assert!(kv.free(a.id));
        assert_eq!(grow(&mut kv, &mut d, 5).unwrap().len(), 5);
        let table = kv.block_table(d.id).to_vec();
        assert_eq!(table.len(), 6);
        for (pos, cell) in table.iter().enumerate() {
            assert_eq!(kv.cells().pos(cell.index()), Some(pos));
        }
    }

    #[test]
    fn out_of_cells_or_seq_ids_changes_nothing() {
        let mut kv = SlotKvManager::new(4, 1);
        let mut a = Request::new(RequestId(1), vec![1, 2, 3], 4);
        grow(&mut kv, &mut a, 3).unwrap();
        assert_eq!(kv.allocate_slots(&a, 2, &PrefixHit::none()), None);
        assert_eq!(kv.block_table(a.id).len(), 3);
        let b = Request::new(RequestId(2), vec![1], 4);
        assert_eq!(
            kv.allocate_slots(&b, 1, &PrefixHit::none()),
            None,
            "the only seq id is taken"
        );
        assert_eq!(kv.block_table(b.id), &[][..]);
        assert_eq!(kv.stats().num_used_blocks, 3);
    }

    #[test]
    fn free_releases_every_cell_and_recycles_the_seq_id() {
        let mut kv = SlotKvManager::new(4, 1);
        let mut a = Request::new(RequestId(1), vec![1, 2, 3], 4);
        grow(&mut kv, &mut a, 3).unwrap();
        assert!(!kv.reset_prefix_cache(), "refused while cells are in use");
        assert!(kv.free(a.id));
        assert!(!kv.free(a.id));
        assert_eq!(kv.stats().num_free_blocks, 4);
        assert!(kv.reset_prefix_cache());
        let mut b = Request::new(RequestId(2), vec![1, 2, 3, 4], 4);
        assert_eq!(grow(&mut kv, &mut b, 4).unwrap().len(), 4);
        assert_eq!(kv.seq_of(b.id), Some(SeqId(0)));
    }

    #[test]
    fn there_is_no_prefix_caching() {
        let mut kv = SlotKvManager::new(8, 2);
        let mut a = Request::new(RequestId(1), vec![1, 2, 3], 4);
        grow(&mut kv, &mut a, 3).unwrap();
        kv.cache_full_blocks(&a);
        let b = Request::new(RequestId(2), vec![1, 2, 3], 4);
        assert_eq!(kv.lookup_prefix(&b), PrefixHit::none());
        assert_eq!(kv.stats().num_cached_blocks, 0);
    }
}
