//! Scheduling one step ahead (vLLM v1's async scheduling): while step N runs on the device, the
//! host schedules step N + 1, so the device need not wait for the host between steps.
//!
//! Step N + 1 is scheduled as usual on the state N leaves behind, as far as it is known now:
//! every chunk of N counted as computed, and every request N samples given one more token, not
//! known yet ("pending"), which is its next chunk. Prompt chunks, admissions and prefill-only
//! requests are scheduled as in any step. What N ends for a reason known now is left out: a
//! request whose sampled token reaches `max_tokens` or `max_model_len`, a prefill-only request
//! whose prompt N completes. A request that N's token ends by a stop token still gets its row:
//! the token is not known before N ends, so the row is computed and dropped, and
//! [`Scheduler::update`] skips a request that finished in between, as it skips an abort. Its KV is
//! never published to the prefix cache: the extra row writes the position after the request's
//! last computed token, in a block that is not full of computed tokens.
//!
//! A step ahead takes free blocks only ([`Room::FreeOnly`]): it cannot take back blocks N is
//! writing. If a running request finds none (it would preempt someone), or N verifies drafts, or
//! forks wait to copy their blocks, there is no step ahead, and the engine schedules after N's
//! update as usual. Admissions look the prefix cache up before N's blocks are published: they
//! may miss what N computes, never hit something wrong.
//!
//! Protocol: `schedule` (or an earlier step ahead) gives step N; run it; `schedule_ahead(&N)`
//! gives step N + 1 with its pending inputs unknown; run it with them filled by the tokens N
//! samples ([`ScheduledAhead::into_parts`]); then `update(N)`, and later `update(N + 1)`, in that
//! order.

use std::collections::HashSet;

use super::{ChunkOutput, Room, Scheduler, SchedulerOutput};
use crate::ids::RequestId;
use crate::request::RequestStatus;

/// The token of a pending chunk until whoever runs the step fills it in: an id no vocabulary
/// has, so a chunk run unfilled fails loudly (token out of range) instead of computing garbage.
pub const PENDING_TOKEN: u32 = u32::MAX;
const PENDING: u32 = PENDING_TOKEN;

/// A step scheduled before the step it continues was applied. Its pending chunks are one token
/// each, the one the previous step samples for their request, not known yet: their `token_ids`
/// are `[PENDING_TOKEN]`, for whoever runs the step to fill ([`Self::into_parts`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledAhead {
    out: SchedulerOutput,
    pending: HashSet<RequestId>,
}

impl ScheduledAhead {
    /// The step, and the indices of its pending chunks (in order), whose `token_ids` are
    /// `[PENDING_TOKEN]`: each is to run with the token the previous step samples for its
    /// request. (`update` counts it as one token computed, as it is.)
    pub fn into_parts(self) -> (SchedulerOutput, Vec<usize>) {
        let pending = (0..self.out.scheduled.len())
            .filter(|&i| self.pending.contains(&self.out.scheduled[i].request_id))
            .collect();
        (self.out, pending)
    }
}

impl Scheduler {
    /// Schedules the step after `inflight` (the last step scheduled, not yet updated) on the
    /// state it leaves behind (see the module's documentation); `None` when that cannot be done
    /// without preempting, or `inflight` verifies drafts. Nothing is changed then, except blocks
    /// some running requests now hold ahead of their next chunk, which that chunk takes.
    pub fn schedule_ahead(&mut self, inflight: &SchedulerOutput) -> Option<ScheduledAhead> {
        if !self.pending_copies.is_empty() {
            return None;
        }
        for s in &inflight.scheduled {
            let r = self.requests.get(&s.request_id)?; // gone since (aborted): in order
            if r.status() != RequestStatus::Running
                || s.start_position != r.num_computed_tokens
                || s.output == ChunkOutput::Verify
            {
                return None;
            }
        }
        if self
            .running
            .iter()
            .any(|id| !self.requests[id].draft_token_ids.is_empty())
        {
            return None;
        }
        let sampled: HashSet<RequestId> = inflight
            .scheduled
            .iter()
            .filter(|s| s.output == ChunkOutput::Sample)
            .map(|s| s.request_id)
            .collect();
        self.project(inflight, true);
        // What `inflight` ends for a reason known now sits this step out.
        let max_model_len = self.config.max_model_len();
        let requests = &self.requests;
        let (ending, running): (Vec<RequestId>, Vec<RequestId>) = self
            .running
            .iter()
            .partition(|id| requests[*id].stop_reason(max_model_len).is_some());
        self.running = running;
        let mut out = SchedulerOutput {
            finished: std::mem::take(&mut self.finished_since_last_step),
            ..SchedulerOutput::default()
        };
        let complete = self.schedule_into(Room::FreeOnly, &mut out);
        // `update(inflight)` finishes them; where they stand in the running order until then
        // matters to nobody.
        self.running.extend(ending);
        self.project(inflight, false);
        if !complete || out.scheduled.is_empty() {
            self.finished_since_last_step = out.finished;
            return None;
        }
        let pending: HashSet<RequestId> = out
            .scheduled
            .iter()
            .map(|s| s.request_id)
            .filter(|id| sampled.contains(id))
            .collect();
        debug_assert!(out
            .scheduled
            .iter()
            .filter(|s| pending.contains(&s.request_id))
            .all(|s| s.token_ids == [PENDING]));
        Some(ScheduledAhead { out, pending })
    }

    /// Applies `inflight` as if it had run (`forward`: every chunk computed, a pending token
    /// appended to each request it samples), or takes that back.
    fn project(&mut self, inflight: &SchedulerOutput, forward: bool) {
        for s in &inflight.scheduled {
            let r = self
                .requests
                .get_mut(&s.request_id)
                .expect("checked by schedule_ahead: this is a bug");
            let samples = s.output == ChunkOutput::Sample;
            if forward {
                r.num_computed_tokens += s.token_ids.len();
                if samples {
                    r.output_token_ids.push(PENDING);
                }
            } else {
                r.num_computed_tokens -= s.token_ids.len();
                if samples {
                    r.output_token_ids.pop();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::finish::FinishReason;
    use crate::request::Request;
    use crate::scheduler::SchedulerConfig;

    fn config(batched: usize, num_blocks: usize) -> SchedulerConfig {
        SchedulerConfig::builder()
            .max_num_batched_tokens(batched)
            .max_num_seqs(4)
            .max_model_len((num_blocks * 4).min(32))
            .block_size(4)
            .num_blocks(num_blocks)
            .build()
            .expect("valid config")
    }

    fn scheduler(num_blocks: usize) -> Scheduler {
        Scheduler::new(config(64, num_blocks))
    }

    fn sampled(out: &SchedulerOutput, token: u32) -> Vec<(RequestId, Vec<u32>)> {
        out.scheduled
            .iter()
            .filter(|s| s.sample())
            .map(|s| (s.request_id, vec![token]))
            .collect()
    }

    /// The step with each pending chunk's input `token(request)`; `None` if one has none.
    fn fill(
        ahead: ScheduledAhead,
        token: impl Fn(RequestId) -> Option<u32>,
    ) -> Option<SchedulerOutput> {
        let (mut out, pending) = ahead.into_parts();
        for i in pending {
            let s = &mut out.scheduled[i];
            assert_eq!(
                s.token_ids,
                [PENDING_TOKEN],
                "a pending chunk's token is unknown"
            );
            s.token_ids = vec![token(s.request_id)?];
        }
        Some(out)
    }

    fn shape(out: &SchedulerOutput) -> Vec<(u64, usize, Vec<u32>, bool)> {
        out.scheduled
            .iter()
            .map(|s| {
                (
                    s.request_id.0,
                    s.start_position,
                    s.token_ids.clone(),
                    s.sample(),
                )
            })
            .collect()
    }

    #[test]
    fn a_decode_step_continues_with_the_token_it_samples() {
        let mut s = scheduler(16);
        s.add_request(Request::new(RequestId(1), vec![1, 2, 3], 8));
        s.add_request(Request::new(RequestId(2), vec![4, 5], 8).with_eos_token_ids(vec![0]));
        let first = s.schedule();
        // The prompts end with a sample: their first output token continues them.
        let ahead = s
            .schedule_ahead(&first)
            .expect("a step of samples continues");
        // Both are pending: each runs on the token `first` samples for it.
        let next = fill(ahead, |id| Some(10 + id.0 as u32)).expect("every token given");
        assert_eq!(
            shape(&next),
            vec![(1, 3, vec![11], true), (2, 2, vec![12], true)]
        );
        assert_eq!(next.num_batched_tokens, 2);
        // Request 2 samples its end token in `first`: its row ahead is computed and dropped.
        let tokens = vec![(RequestId(1), vec![11]), (RequestId(2), vec![0])];
        let updates = s.update(&first, &tokens);
        assert_eq!(updates[1].finish_reason, Some(FinishReason::Stop));
        let updates = s.update(&next, &sampled(&next, 7));
        assert_eq!(updates.len(), 1, "the finished request is skipped");
        assert_eq!(updates[0].new_token_ids, vec![7]);
        let r = s.request(RequestId(1)).expect("running");
        assert_eq!(r.output_token_ids, vec![11, 7]);
        assert_eq!(r.num_computed_tokens, 4);
        assert_eq!(s.kv_stats().num_used_blocks, 1);
    }

    #[test]
    fn what_the_step_ends_by_length_sits_the_step_ahead_out() {
        let mut s = scheduler(16);
        s.add_request(Request::new(RequestId(1), vec![1, 2, 3], 1));
        s.add_request(Request::new(RequestId(2), vec![4], 8));
        let first = s.schedule();
        let ahead = s.schedule_ahead(&first).expect("request 2 continues");
        let next = fill(ahead, |_| Some(7)).expect("request 2 pending");
        assert_eq!(shape(&next), vec![(2, 1, vec![7], true)]);
        // Nobody left to run: no step ahead, and nothing taken from the next one.
        let mut s = scheduler(16);
        s.add_request(Request::new(RequestId(1), vec![1, 2, 3], 1));
        let first = s.schedule();
        s.add_request(Request::new(RequestId(9), vec![], 1)); // ignored: reported next step
        assert!(s.schedule_ahead(&first).is_none());
        s.update(&first, &sampled(&first, 5));
        let reported: Vec<_> = s.schedule().finished.iter().map(|f| f.request_id).collect();
        assert!(reported.contains(&RequestId(9)) && reported.contains(&RequestId(1)));
    }

    #[test]
    fn prompt_chunks_and_arrivals_are_scheduled_ahead() {
        // A four-token budget: a ten-token prompt runs in chunks.
        let mut s = Scheduler::new(config(4, 16));
        s.add_request(Request::new(RequestId(1), (0..10).collect(), 8));
        let chunk = s.schedule();
        assert_eq!(shape(&chunk), vec![(1, 0, vec![0, 1, 2, 3], false)]);
        let ahead = s.schedule_ahead(&chunk).expect("the next chunk is known");
        let second = fill(ahead, |_| None).expect("nothing pending");
        assert_eq!(shape(&second), vec![(1, 4, vec![4, 5, 6, 7], false)]);
        // A request that arrives meanwhile is admitted ahead beside a pending decode.
        s.update(&chunk, &[]);
        let third = s.schedule_ahead(&second).expect("the last chunk");
        let third = fill(third, |_| None).expect("nothing pending");
        assert_eq!(shape(&third), vec![(1, 8, vec![8, 9], true)]);
        s.update(&second, &[]);
        s.add_request(Request::new(RequestId(2), vec![20, 21], 8));
        let fourth = s.schedule_ahead(&third).expect("a decode and an admission");
        // Only request 1's decode is pending; request 2's prompt is known.
        let fourth = fill(fourth, |_| Some(30)).expect("one pending");
        assert_eq!(
            shape(&fourth),
            vec![(1, 10, vec![30], true), (2, 0, vec![20, 21], true)]
        );
        s.update(&third, &[(RequestId(1), vec![30])]);
        s.update(&fourth, &sampled(&fourth, 31));
        assert_eq!(
            s.request(RequestId(1)).expect("running").output_token_ids,
            vec![30, 31]
        );
        assert_eq!(
            s.request(RequestId(2)).expect("running").output_token_ids,
            vec![31]
        );
    }

    #[test]
    fn drafts_stop_a_step_ahead() {
        let mut s = scheduler(16);
        s.add_request(Request::new(RequestId(1), vec![1, 2], 8));
        let first = s.schedule();
        s.update(&first, &sampled(&first, 5));
        assert!(s.set_draft(RequestId(1), vec![6, 7]));
        // A draft waits for the next step: nothing is scheduled ahead of it.
        let second = s.schedule();
        assert_eq!(second.scheduled[0].output, ChunkOutput::Verify);
        assert!(
            s.schedule_ahead(&second).is_none(),
            "a verify's tokens are unknown"
        );
        s.update(&second, &[(RequestId(1), vec![6, 7, 8])]);
        let third = s.schedule();
        assert!(s.set_draft(RequestId(1), vec![9]));
        assert!(s.schedule_ahead(&third).is_none(), "a draft is set");
    }

    #[test]
    fn a_step_ahead_takes_free_blocks_only() {
        // Two blocks: request 1's prompt fills one, its next token needs the second.
        let mut s = scheduler(2);
        s.add_request(Request::new(RequestId(1), vec![1, 2, 3], 8));
        let first = s.schedule();
        s.update(&first, &sampled(&first, 5)); // 4 tokens: block 0 full
        let second = s.schedule(); // computes token 3 (position 3)
        let ahead = s.schedule_ahead(&second).expect("block 1 is free");
        let next = fill(ahead, |_| Some(6)).expect("token given");
        assert_eq!(next.scheduled[0].start_position, 4);
        assert_eq!(next.scheduled[0].block_table.len(), 2);
        // Request 2 takes the last free block: request 1 cannot go on without preempting.
        let mut s = scheduler(2);
        s.add_request(Request::new(RequestId(1), vec![1, 2, 3], 8));
        s.add_request(Request::new(RequestId(2), vec![4], 8));
        let first = s.schedule();
        s.update(&first, &sampled(&first, 5));
        let second = s.schedule();
        assert!(s.schedule_ahead(&second).is_none(), "the pool is short");
        // The state is the one `second` left: its update and a full schedule go on.
        s.update(&second, &sampled(&second, 6));
        let third = s.schedule();
        assert_eq!(third.preempted, vec![RequestId(2)]);
    }

    #[test]
    fn an_abort_after_a_step_is_scheduled_stops_its_step_ahead() {
        let mut s = scheduler(16);
        s.add_request(Request::new(RequestId(1), vec![1, 2], 8));
        s.add_request(Request::new(RequestId(2), vec![3], 8));
        let first = s.schedule();
        s.abort_request(RequestId(2));
        // The aborted request is in `first` but runs no more: schedule after the update.
        assert!(s.schedule_ahead(&first).is_none());
    }

    #[test]
    fn a_missing_token_is_refused() {
        let mut s = scheduler(16);
        s.add_request(Request::new(RequestId(1), vec![1, 2], 8));
        let first = s.schedule();
        let ahead = s.schedule_ahead(&first).expect("continues");
        assert!(fill(ahead, |_| None).is_none());
    }
}
