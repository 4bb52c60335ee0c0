//! Prompt lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of a
//! request's longest suffix n-gram, from an index per request kept up to date as its tokens
//! arrive. Proposing costs next to nothing, so [`DraftPolicy`] weighs only the verify rows.

use std::collections::HashMap;

use novainfer_core::{NgramIndex, NgramRange, Request, RequestId};

use crate::draft_policy::{Decoding, DraftPolicy};
use crate::proposer::{held, Proposer, Running};

pub struct NgramProposer {
    range: NgramRange,
    /// Per request: the index of its prompt and output so far.
    indexes: HashMap<RequestId, NgramIndex>,
    policy: DraftPolicy,
}

impl NgramProposer {
    pub fn new(range: NgramRange, policy: DraftPolicy) -> Self {
        Self {
            range,
            indexes: HashMap::new(),
            policy,
        }
    }

    /// Up to `k` tokens to follow `request`'s tokens so far.
    fn lookup(&mut self, request: &Request, k: usize) -> Vec<u32> {
        let range = self.range;
        let index = self
            .indexes
            .entry(request.id)
            .or_insert_with(|| NgramIndex::new(range));
        // Catch up with what arrived since the last step (a whole prompt the first time).
        if index.tokens().len() > request.num_tokens() {
            *index = NgramIndex::new(range);
        }
        let known = index.tokens().len();
        index.extend(&request.token_ids(known..request.num_tokens()));
        index.propose(k)
    }
}

impl Proposer for NgramProposer {
    fn propose(
        &mut self,
        running: &mut dyn Running,
        ids: &[RequestId],
        room: usize,
    ) -> Vec<Vec<u32>> {
        let requests = held(running, ids);
        let decoding: Vec<Decoding> = requests.iter().map(|(_, r)| Decoding::new(r, 0)).collect();
        let lengths = self.policy.plan(&decoding, room);
        let mut drafts = vec![Vec::new(); ids.len()];
        for ((i, request), k) in requests.into_iter().zip(lengths) {
            drafts[i] = self.lookup(request, k);
        }
        drafts
    }

    fn record(&mut self, id: RequestId, drafted: usize, accepted: usize) {
        self.policy.record(id, drafted, accepted);
    }

    fn observe_step(&mut self, rows: usize, seconds: f64) {
        self.policy.observe_step(rows, seconds);
    }

    fn retain(&mut self, alive: &mut dyn FnMut(RequestId) -> bool) {
        self.policy.retain(&mut *alive);
        self.indexes.retain(|id, _| alive(*id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec_config::DraftPolicyKind;

    #[test]
    fn the_proposer_follows_a_request_as_its_tokens_arrive() {
        let policy = DraftPolicy::new(3, DraftPolicyKind::Adaptive, 0.1, None);
        let mut p = NgramProposer::new(NgramRange::new(2, 3).expect("valid"), policy);
        let id = RequestId(1);
        let mut running = HashMap::from([(id, Request::new(id, vec![5, 6, 7, 8, 9, 5, 6], 10))]);
        assert_eq!(p.propose(&mut running, &[id], 8), vec![vec![7, 8, 9]]);
        running
            .get_mut(&id)
            .expect("held")
            .output_token_ids
            .extend([7, 1]);
        assert_eq!(p.propose(&mut running, &[id], 8), vec![Vec::<u32>::new()]);
        // A request the scheduler no longer holds keeps its place, with no draft.
        assert_eq!(
            p.propose(&mut running, &[RequestId(9), id], 8),
            vec![Vec::<u32>::new(); 2]
        );
        p.retain(&mut |_| false);
        assert!(p.indexes.is_empty());
    }
}
