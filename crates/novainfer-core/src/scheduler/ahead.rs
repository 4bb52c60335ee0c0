//! Scheduling one step ahead (vLLM v1's async scheduling): while step N runs on the device, the
//! host schedules step N + 1 as its continuation, so the device need not wait for the host
//! between steps.
//!
//! Only a step of plain decodes has a continuation that does not depend on what it samples:
//! every running request ran in it, each ending its known tokens with a sample, nobody waits to
//! be admitted, no drafts. Step N + 1 then gives each of them one token, the one N samples for
//! it, at the position after N's; its blocks are taken from the free pool only (a step ahead
//! never preempts: a short pool makes the engine schedule after N's update as usual). A request
//! that N's token ends by length (`max_tokens`, `max_model_len`) is left out, since that is known
//! now. One that N's token ends by a stop token still gets its row: the token is not known
//! before N ends, so the row is computed and dropped, and [`Scheduler::update`] skips a request
//! that finished in between, as it skips an abort. Its KV is never published to the prefix
//! cache: the extra row writes the position after the request's last computed token, in a block
//! that is not full of computed tokens.
//!
//! Protocol: `schedule` (or an earlier step ahead) gives step N; run it; `schedule_ahead(&N)`
//! gives step N + 1 with its input tokens unknown; once N has sampled, fill them
//! ([`ScheduledAhead::into_output`]) and run N + 1; then `update(N)`, and later `update(N + 1)`,
//! in that order.

use super::{ChunkOutput, FinishedRequest, ScheduledRequest, Scheduler, SchedulerOutput};
use crate::ids::RequestId;
use crate::request::{RequestKind, RequestStatus};

/// A step scheduled before the step it continues was applied: each chunk is one token, the
/// one the previous step samples for its request, not known yet. The only way to a
/// [`SchedulerOutput`] is [`Self::into_output`], which fills them in.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledAhead {
    out: SchedulerOutput,
}

impl ScheduledAhead {
    /// The requests of the step, in order (each computes one token).
    pub fn request_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.out.scheduled.iter().map(|s| s.request_id)
    }

    /// The requests that left the scheduler since the last step (as in
    /// [`SchedulerOutput::finished`]; the output keeps them too): reported before the inputs are
    /// known, and even if the step is then abandoned.
    pub fn finished(&self) -> &[FinishedRequest] {
        &self.out.finished
    }

    /// The step with each chunk's input, `token(request)`: the token the previous step sampled
    /// for it. `None` if a request has none (a caller's bug: every request of a step ahead
    /// samples in the step it continues).
    pub fn into_output(
        mut self,
        mut token: impl FnMut(RequestId) -> Option<u32>,
    ) -> Option<SchedulerOutput> {
        for s in &mut self.out.scheduled {
            s.token_ids = vec![token(s.request_id)?];
        }
        Some(self.out)
    }
}

impl Scheduler {
    /// Schedules the step after `inflight` (the last step scheduled, not yet updated) as its
    /// continuation, when it is one of plain decodes and the pool has room without preempting
    /// anyone (see the module's documentation); `None` otherwise (nothing changed then, except
    /// blocks some requests now hold for their next token, which their next step takes).
    pub fn schedule_ahead(&mut self, inflight: &SchedulerOutput) -> Option<ScheduledAhead> {
        if !self.waiting.is_empty() || !self.pending_copies.is_empty() {
            return None;
        }
        // Every running request is continued, or the order of who runs would change.
        if inflight.scheduled.len() != self.running.len() {
            return None;
        }
        let max_model_len = self.config.max_model_len();
        let mut continued = Vec::with_capacity(inflight.scheduled.len());
        for s in &inflight.scheduled {
            let r = self.requests.get(&s.request_id)?;
            let plain_decode = r.status() == RequestStatus::Running
                && r.kind == RequestKind::Generate
                && s.output == ChunkOutput::Sample
                && r.draft_token_ids.is_empty()
                && s.start_position == r.num_computed_tokens
                && s.start_position + s.token_ids.len() == r.num_tokens();
            if !plain_decode {
                return None;
            }
            // The token `inflight` samples makes these many output tokens and tokens.
            let ends_by_length =
                r.output_token_ids.len() + 1 >= r.max_tokens || r.num_tokens() + 1 >= max_model_len;
            if !ends_by_length {
                continued.push((s.request_id, s.token_ids.len()));
            }
        }
        if continued.is_empty() {
            return None;
        }
        for &(id, len) in &continued {
            // `inflight`'s chunk and the one token after it.
            if !self.try_allocate(id, len + 1) {
                return None;
            }
        }
        self.num_steps += 1;
        let mut out = SchedulerOutput {
            finished: std::mem::take(&mut self.finished_since_last_step),
            ..SchedulerOutput::default()
        };
        for (id, _) in continued {
            let r = &self.requests[&id];
            out.scheduled.push(ScheduledRequest {
                request_id: id,
                // Filled by `ScheduledAhead::into_output`.
                token_ids: Vec::new(),
                // The position of the token `inflight` samples.
                start_position: r.num_tokens(),
                block_table: self.kv.as_dyn().block_table(id).to_vec(),
                output: ChunkOutput::Sample,
                is_resumed_from_preemption: false,
                adapter: r.adapter,
            });
            out.num_batched_tokens += 1;
        }
        Some(ScheduledAhead { out })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::finish::FinishReason;
    use crate::request::Request;
    use crate::scheduler::SchedulerConfig;

    fn scheduler(num_blocks: usize) -> Scheduler {
        Scheduler::new(
            SchedulerConfig::builder()
                .max_num_batched_tokens(64)
                .max_num_seqs(4)
                .max_model_len((num_blocks * 4).min(32))
                .block_size(4)
                .num_blocks(num_blocks)
                .build()
                .expect("valid config"),
        )
    }

    fn sampled(out: &SchedulerOutput, token: u32) -> Vec<(RequestId, Vec<u32>)> {
        out.scheduled
            .iter()
            .filter(|s| s.sample())
            .map(|s| (s.request_id, vec![token]))
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
        assert_eq!(
            ahead.request_ids().collect::<Vec<_>>(),
            vec![RequestId(1), RequestId(2)]
        );
        let next = ahead
            .into_output(|id| Some(10 + id.0 as u32))
            .expect("every token given");
        assert_eq!(next.scheduled[0].token_ids, vec![11]);
        assert_eq!(next.scheduled[0].start_position, 3);
        assert_eq!(next.scheduled[1].start_position, 2);
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
    }

    #[test]
    fn a_request_its_token_ends_by_length_is_left_out() {
        let mut s = scheduler(16);
        s.add_request(Request::new(RequestId(1), vec![1, 2, 3], 1));
        s.add_request(Request::new(RequestId(2), vec![4], 8));
        let first = s.schedule();
        let ahead = s.schedule_ahead(&first).expect("request 2 continues");
        assert_eq!(ahead.request_ids().collect::<Vec<_>>(), vec![RequestId(2)]);
        // Nobody left to continue: no step ahead.
        let mut s = scheduler(16);
        s.add_request(Request::new(RequestId(1), vec![1, 2, 3], 1));
        let first = s.schedule();
        assert!(s.schedule_ahead(&first).is_none());
    }

    #[test]
    fn waiting_requests_prompt_chunks_and_drafts_stop_a_step_ahead() {
        // A waiting request is admitted by a full schedule.
        let mut s = scheduler(16);
        s.add_request(Request::new(RequestId(1), vec![1, 2], 8));
        let first = s.schedule();
        s.add_request(Request::new(RequestId(2), vec![3], 8));
        assert!(s.schedule_ahead(&first).is_none());
        // A prompt chunk samples nothing.
        let s = &mut Scheduler::new(
            SchedulerConfig::builder()
                .max_num_batched_tokens(4)
                .max_num_seqs(4)
                .max_model_len(32)
                .block_size(4)
                .num_blocks(16)
                .build()
                .expect("valid config"),
        );
        s.add_request(Request::new(RequestId(1), (0..10).collect(), 8));
        let chunk = s.schedule();
        assert!(s.schedule_ahead(&chunk).is_none());
        // A draft makes a verify.
        let mut s = scheduler(16);
        s.add_request(Request::new(RequestId(1), vec![1, 2], 8));
        let first = s.schedule();
        s.update(&first, &sampled(&first, 5));
        assert!(s.set_draft(RequestId(1), vec![6, 7]));
        let verify = s.schedule();
        assert_eq!(verify.scheduled[0].output, ChunkOutput::Verify);
        assert!(s.schedule_ahead(&verify).is_none());
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
        let next = ahead.into_output(|_| Some(6)).expect("token given");
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
    }

    #[test]
    fn an_abort_after_a_step_is_scheduled_stops_its_step_ahead() {
        let mut s = scheduler(16);
        s.add_request(Request::new(RequestId(1), vec![1, 2], 8));
        s.add_request(Request::new(RequestId(2), vec![3], 8));
        let first = s.schedule();
        s.abort_request(RequestId(2));
        // The aborted request is in `first` but runs no more: not a continuation of it.
        assert!(s.schedule_ahead(&first).is_none());
    }

    #[test]
    fn a_missing_token_is_refused() {
        let mut s = scheduler(16);
        s.add_request(Request::new(RequestId(1), vec![1, 2], 8));
        let first = s.schedule();
        let ahead = s.schedule_ahead(&first).expect("continues");
        assert!(ahead.into_output(|_| None).is_none());
    }
}
