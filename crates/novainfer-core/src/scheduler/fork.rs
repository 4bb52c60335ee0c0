//! `n > 1`: a request's other completions start as forks of it.
//!
//! The engine keeps the children back until the parent's prompt is computed,
//! samples each child's first token (with the child's own sampler) from the
//! parent's last prompt logits, and hands them to
//! [`Scheduler::update_with_forks`]. A child then runs on the parent's KV:
//! full blocks shared by refcount, a partial last block copied by the model
//! ([`SchedulerOutput::block_copies`](super::SchedulerOutput)). So the prompt is
//! computed once however large `n` is. When that is impossible right now (all
//! `max_num_seqs` slots taken, no block for the copy) the child waits at the front
//! of the queue and recomputes the prompt like a preempted request, still sharing
//! what the prefix cache holds.

use crate::finish::FinishReason;
use crate::ids::RequestId;
use crate::request::Request;

use super::{RequestUpdate, Scheduler};

/// One child of an `n > 1` request.
#[derive(Debug, Clone)]
pub struct Fork {
    pub parent: RequestId,
    /// A fresh request with the parent's prompt and limits and no output yet.
    pub child: Request,
    /// The child's first token, sampled from the parent's last prompt logits.
    pub first_token: u32,
}

impl Scheduler {
    /// Starts `fork.child` from its parent, which must hold exactly its computed
    /// prompt (this step's update of it is applied). `queue_pos` counts children
    /// already queued by this update, so that queued children keep their order.
    pub(super) fn start_fork(&mut self, fork: Fork, queue_pos: &mut usize) -> RequestUpdate {
        let Fork {
            parent,
            mut child,
            first_token,
        } = fork;
        let parent = &self.requests[&parent];
        assert_eq!(
            parent.num_computed_tokens,
            parent.num_prompt_tokens(),
            "fork of {} before its prompt was computed: this is a bug",
            parent.id
        );
        assert_eq!(
            child.prompt_token_ids, parent.prompt_token_ids,
            "fork with another prompt: this is a bug"
        );
        child.arrival_seq = self.next_arrival_seq;
        self.next_arrival_seq += 1;
        // A completion of the same request: it ages, ranks and counts as its parent does.
        child.arrival_step = parent.arrival_step;
        child.priority = parent.priority;
        child.tenant = parent.tenant;
        child.output_token_ids.push(first_token);
        child.num_cached_tokens = parent.num_cached_tokens;
        let id = child.id;
        let update = RequestUpdate {
            request_id: id,
            new_token_ids: vec![first_token],
            finish_reason: child.stop_reason(self.config.max_model_len()),
            num_cached_tokens: child.num_cached_tokens,
        };
        let forked =
            if update.finish_reason.is_some() || self.running.len() >= self.config.max_num_seqs() {
                None
            } else {
                self.kv.as_dyn_mut().fork(parent, id)
            };
        let num_computed = parent.num_computed_tokens;
        self.requests.insert(id, child);
        if let Some(reason) = update.finish_reason {
            // Done at its first token: it never needs KV.
            self.finish_request(id, reason);
            return update;
        }
        match forked {
            Some(copy) => {
                self.pending_copies.extend(copy);
                let child = self.requests.get_mut(&id).expect("inserted above");
                child.num_computed_tokens = num_computed;
                child.start_running();
                self.running.push(id);
            }
            None => {
                // Behind the children queued before it, ahead of everyone else.
                self.waiting
                    .insert((*queue_pos).min(self.waiting.len()), id);
                *queue_pos += 1;
            }
        }
        update
    }

    /// A fork whose parent left before its update (aborted): the child ends too.
    pub(super) fn drop_fork(&mut self, fork: Fork) {
        let mut child = fork.child;
        child.arrival_seq = self.next_arrival_seq;
        self.next_arrival_seq += 1;
        let id = child.id;
        self.requests.insert(id, child);
        self.finish_request(id, FinishReason::Abort);
    }
}
