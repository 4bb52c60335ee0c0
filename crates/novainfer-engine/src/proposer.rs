//! What the step loop asks of a speculative proposer, whatever makes its drafts: prompt lookup
//! ([`crate::ngram_proposer`]), a draft model ([`crate::draft_proposer`]), and later suffix
//! decoding or EAGLE-style heads. After each step the loop hands the proposer the decoding
//! requests and the room the next step has for draft tokens; it reports back what each
//! verification accepted and what pure decode steps cost, so a proposer can size its drafts,
//! and which requests left.
//!
//! A proposer sees the requests through [`Running`], the scheduler's view of them, so one
//! whose state lives in the requests' KV blocks (a draft model's KV) can reach those blocks
//! and have them cover what it writes ahead of the target.

use novainfer_core::{BlockId, Request, RequestId, Scheduler};

/// The running requests as the scheduler holds them, and the blocks their KV lives in.
pub trait Running {
    /// An unfinished request.
    fn request(&self, id: RequestId) -> Option<&Request>;
    /// `id`'s block table, in position order (empty if it holds no blocks).
    fn block_table(&self, id: RequestId) -> &[BlockId];
    /// Makes `id`'s table cover its first `num_positions` positions with free blocks, never
    /// preempting ([`Scheduler::reserve_slots`]); false, with nothing changed, if it cannot.
    fn reserve(&mut self, id: RequestId, num_positions: usize) -> bool;
}

impl Running for Scheduler {
    fn request(&self, id: RequestId) -> Option<&Request> {
        Scheduler::request(self, id)
    }
    fn block_table(&self, id: RequestId) -> &[BlockId] {
        self.kv().as_dyn().block_table(id)
    }
    fn reserve(&mut self, id: RequestId, num_positions: usize) -> bool {
        self.reserve_slots(id, num_positions)
    }
}

/// Drafts tokens for the scheduler to verify ([`novainfer_core::Scheduler::set_draft`]).
///
/// A draft only saves forward passes: verification keeps the output exact whatever is
/// proposed, so a proposer that fails proposes nothing rather than failing requests.
pub trait Proposer: Send {
    /// Drafts to follow the tokens so far of each of `ids` (decoding requests `running`
    /// holds, in running order), one per id (empty: nothing to propose), `room` draft tokens
    /// at most in all.
    fn propose(
        &mut self,
        running: &mut dyn Running,
        ids: &[RequestId],
        room: usize,
    ) -> Vec<Vec<u32>>;

    /// The verification of `id`'s draft of `drafted` tokens confirmed `accepted` of them.
    fn record(&mut self, id: RequestId, drafted: usize, accepted: usize);

    /// A pure decode step of the target over `rows` rows (decodes and draft tokens) took
    /// `seconds`.
    fn observe_step(&mut self, rows: usize, seconds: f64);

    /// Keeps the state of requests for which `alive` holds and forgets the others.
    fn retain(&mut self, alive: &mut dyn FnMut(RequestId) -> bool);

    /// `id` was preempted: its blocks were freed, and whatever the proposer kept in them with
    /// them. A proposer whose state lives apart from the blocks has nothing to do.
    fn preempted(&mut self, _id: RequestId) {}
}

/// The requests of `ids` that `running` holds, each with its place in `ids` (a proposer
/// answers one draft per id, so a request gone since the ids were taken keeps its place).
pub fn held<'a>(running: &'a dyn Running, ids: &[RequestId]) -> Vec<(usize, &'a Request)> {
    ids.iter()
        .enumerate()
        .filter_map(|(i, &id)| Some((i, running.request(id)?)))
        .collect()
}

/// Cuts `drafts` (in running order) to `room` tokens in all, one token per request per round,
/// so every request keeps a share.
pub fn share_room(drafts: &mut [Vec<u32>], room: usize) {
    let wanted: usize = drafts.iter().map(Vec::len).sum();
    if wanted <= room {
        return;
    }
    let mut keep = vec![0usize; drafts.len()];
    let mut left = room;
    while left > 0 {
        let mut gave = false;
        for (k, d) in keep.iter_mut().zip(drafts.iter()) {
            if left > 0 && *k < d.len() {
                *k += 1;
                left -= 1;
                gave = true;
            }
        }
        if !gave {
            break;
        }
    }
    for (d, k) in drafts.iter_mut().zip(keep) {
        d.truncate(k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn drafts_share_the_room_one_token_a_round() {
        let mut drafts = vec![vec![1, 2, 3, 4], vec![5], vec![6, 7, 8]];
        share_room(&mut drafts, 5);
        assert_eq!(drafts, vec![vec![1, 2], vec![5], vec![6, 7]]);
        share_room(&mut drafts, 0);
        assert!(drafts.iter().all(Vec::is_empty));
        let mut few = vec![vec![1], vec![2]];
        share_room(&mut few, 8);
        assert_eq!(few, vec![vec![1], vec![2]]);
    }

    /// Requests without blocks: the fake scheduler of proposers that keep nothing in KV.
    impl Running for HashMap<RequestId, Request> {
        fn request(&self, id: RequestId) -> Option<&Request> {
            self.get(&id)
        }
        fn block_table(&self, _: RequestId) -> &[BlockId] {
            &[]
        }
        fn reserve(&mut self, _: RequestId, _: usize) -> bool {
            false
        }
    }

    #[test]
    fn a_request_gone_keeps_its_place_among_the_ids() {
        let running: HashMap<RequestId, Request> = [1, 3]
            .map(|id| (RequestId(id), Request::new(RequestId(id), vec![1], 4)))
            .into();
        let places: Vec<(usize, RequestId)> =
            held(&running, &[RequestId(1), RequestId(2), RequestId(3)])
                .into_iter()
                .map(|(i, r)| (i, r.id))
                .collect();
        assert_eq!(places, vec![(0, RequestId(1)), (2, RequestId(3))]);
    }
}
