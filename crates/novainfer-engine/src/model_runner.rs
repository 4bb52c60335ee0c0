//! `ModelRunner`: the engine's side of the device seam. It turns a `SchedulerOutput`
//! (logical: token ids, positions, block tables) into one flattened `ForwardBatch`
//! (physical: slot mapping) and hands it to the device's [`Executor`], CPU or GPU, which runs
//! on a thread of its own ([`DeviceThread`]): [`ModelRunner::launch`] returns at once, so the
//! engine can schedule the next step while this one runs. A step may take some inputs from the
//! tokens the step launched before it draws ([`Chained`]): the device thread fills them in just
//! before its forward, so the engine thread need not wait for them. A draft model runs its own
//! passes over the same blocks through a runner of its own ([`Span`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use novainfer_core::{slot_mapping, AdapterId, BlockId, ChunkOutput, RequestId, SchedulerOutput};
use novainfer_model::{
    AdapterRef, Capabilities, Device, Draw, Enqueued, Executor, ForwardBatch, ForwardOutput,
    Qwen2Config, SpanOutput,
};

use crate::device_thread::{DeviceThread, PassJob, Pending};
use crate::error::{EngineError, Result};

/// A forward pass handed to the device thread: its output once it has run.
pub struct PendingForward(Pending<Result<ForwardOutput>>);

impl PendingForward {
    /// Blocks until the pass has run.
    pub fn wait(self) -> Result<ForwardOutput> {
        self.0.wait()?
    }
}

/// Which launch a forward pass was, in launch order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchId(u64);

/// Inputs a step takes from the tokens drawn by the step launched just before it (`after`):
/// chunk `i` of the step (one token, [`PENDING_TOKEN`](novainfer_core::PENDING_TOKEN) in the
/// scheduler's output) gets that step's `k`-th drawn token, for each `(i, k)` of `inputs`.
#[derive(Debug, Clone)]
pub struct Chained {
    pub after: LaunchId,
    pub inputs: Vec<(usize, usize)>,
}

/// What the passes launched so far left behind: written and read only by jobs on the device
/// thread, which enqueue and finish passes in launch order.
#[derive(Debug, Default)]
struct Launches {
    /// The last pass enqueued on the device.
    enqueued: Option<LaunchId>,
    /// The last pass read back, and the tokens it drew (none if it failed).
    finished: (Option<LaunchId>, Vec<u32>),
    /// The last pass that failed.
    failed: Option<LaunchId>,
}

type LastDrawn = Arc<Mutex<Launches>>;

/// One launch as the device thread runs it: block copies and the forward pass enqueued, then
/// read back ([`PassJob`]).
struct LaunchJob {
    id: LaunchId,
    batch: ForwardBatch,
    /// The launch whose draws feed this one, and which `(flat token, k)` they feed.
    chained: Option<(LaunchId, Vec<(usize, usize)>)>,
    /// Whether the executor takes the chained tokens from its own draws on the device.
    on_device: bool,
    copies: Vec<(usize, usize, usize)>,
    launches: LastDrawn,
    expects_follower: bool,
}

impl LaunchJob {
    fn launches(&self) -> std::sync::MutexGuard<'_, Launches> {
        // Poisoned only by a panic inside this lock, which holds no invariant across it.
        self.launches
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl PassJob for LaunchJob {
    type Output = Result<ForwardOutput>;

    fn waits_for_previous(&self, executor: &dyn Executor) -> bool {
        self.chained.is_some() && !executor.chains_on_device(&self.batch)
    }

    fn expects_follower(&self) -> bool {
        self.expects_follower
    }

    fn enqueue(&mut self, executor: &mut dyn Executor) -> Result<Enqueued> {
        let result = self.enqueue_inner(executor);
        let mut launches = self.launches();
        launches.enqueued = Some(self.id);
        if result.is_err() {
            launches.failed = Some(self.id);
        }
        result
    }

    fn finish(self, output: Result<ForwardOutput>) -> Result<ForwardOutput> {
        let mut launches = self.launches();
        let drawn = match &output {
            Ok(o) => o.tokens.iter().map(|t| t.token_id).collect(),
            Err(_) => Vec::new(),
        };
        launches.finished = (Some(self.id), drawn);
        // A pass that took its inputs on the device from one that failed read what that one
        // left in its buffers: it fails too.
        let output = match (&self.chained, output) {
            (Some((after, _)), Ok(_)) if self.on_device && launches.failed == Some(*after) => {
                Err(EngineError::StepFailed {
                    message: format!("{after:?}, whose tokens this step took, failed"),
                })
            }
            (_, output) => output,
        };
        if output.is_err() {
            launches.failed = Some(self.id);
        }
        output
    }
}

impl LaunchJob {
    fn enqueue_inner(&mut self, executor: &mut dyn Executor) -> Result<Enqueued> {
        let mut device_inputs = Vec::new();
        if let Some((after, inputs)) = &self.chained {
            let launches = self.launches();
            if executor.chains_on_device(&self.batch) {
                // The executor takes them from the draws of the pass enqueued just before.
                if launches.enqueued != Some(*after) || launches.failed == Some(*after) {
                    return Err(EngineError::StepFailed {
                        message: format!(
                            "a step chained to {after:?}: the last pass enqueued was {:?}{}",
                            launches.enqueued,
                            if launches.failed == Some(*after) {
                                ", and it failed"
                            } else {
                                ""
                            }
                        ),
                    });
                }
                drop(launches);
                // A valid id in place of the pending one until the device writes the token.
                for &(flat, _) in inputs {
                    self.batch.token_ids[flat] = 0;
                }
                device_inputs.clone_from(inputs);
                self.on_device = true;
            } else {
                let (after, inputs) = (*after, inputs.clone());
                let finished = launches.finished.clone();
                drop(launches);
                fill_chained(&mut self.batch, &finished, after, &inputs)?;
            }
        }
        for &(src, dst, num_tokens) in &self.copies {
            executor.copy_block(src, dst, num_tokens)?;
        }
        if !self.expects_follower {
            // Steps in order (no async scheduling): nothing would run behind this pass, so
            // it runs through the plain forward, as it always has.
            return Ok(Enqueued::Done(executor.forward(&self.batch)?));
        }
        Ok(executor.enqueue(&self.batch, &device_inputs)?)
    }
}

/// The rows of a step the backend draws itself: sampled requests' next tokens, and verified
/// requests' rows (one rule per token: the sampler's after the draft's first i tokens).
#[derive(Debug, Default)]
pub struct DeviceDraws {
    pub samples: HashMap<RequestId, Draw>,
    pub verifies: HashMap<RequestId, Vec<Draw>>,
}

/// One request's chunk of a forward pass in the scheduler's terms: its tokens at positions
/// `start_position..`, whose KV is written to (and read from) the blocks of `block_table`.
pub struct Span<'a> {
    pub token_ids: &'a [u32],
    pub start_position: usize,
    pub block_table: &'a [BlockId],
    pub output: SpanOutput,
    pub adapter: Option<AdapterRef>,
}

/// What an executor says about itself, read once: it never changes while it runs.
struct Facts {
    config: Qwen2Config,
    device: Device,
    capabilities: Capabilities,
    block_size: usize,
    num_blocks: usize,
    kv_bytes_per_block: usize,
    weight_bytes_per_token: Option<usize>,
    weight_bytes: Option<usize>,
}

pub struct ModelRunner {
    executor: DeviceThread,
    facts: Facts,
    next_launch: u64,
    launches: LastDrawn,
    /// The engine launches steps ahead (async scheduling): a pass may be left on the device
    /// while the device thread takes the next one.
    steps_ahead: bool,
}

impl ModelRunner {
    pub fn new(executor: Box<dyn Executor>) -> Self {
        let facts = Facts {
            config: executor.config().clone(),
            device: executor.device(),
            capabilities: executor.capabilities(),
            block_size: executor.block_size(),
            num_blocks: executor.num_blocks(),
            kv_bytes_per_block: executor.kv_bytes_per_block(),
            weight_bytes_per_token: executor.weight_bytes_per_token(),
            weight_bytes: executor.weight_bytes(),
        };
        Self {
            executor: DeviceThread::spawn(executor),
            facts,
            next_launch: 0,
            launches: LastDrawn::default(),
            steps_ahead: false,
        }
    }

    /// Says whether the engine launches steps ahead of their predecessors' results (async
    /// scheduling): then a launched pass stays on the device while the device thread looks for
    /// the next one, so the device never waits on the host between them.
    pub fn launch_steps_ahead(&mut self, on: bool) {
        self.steps_ahead = on;
    }

    pub fn config(&self) -> &Qwen2Config {
        &self.facts.config
    }

    pub fn device(&self) -> Device {
        self.facts.device
    }

    /// What the backend can do; the engine asks this rather than the device kind.
    pub fn capabilities(&self) -> Capabilities {
        self.facts.capabilities
    }

    /// Bytes of one pool entry (a block, or a cell in the SLOT layout).
    pub fn kv_bytes_per_block(&self) -> usize {
        self.facts.kv_bytes_per_block
    }

    /// Weight bytes a decode step reads, where the executor knows them.
    pub fn weight_bytes_per_token(&self) -> Option<usize> {
        self.facts.weight_bytes_per_token
    }

    /// Bytes the weights occupy on the device, where the executor knows them.
    pub fn weight_bytes(&self) -> Option<usize> {
        self.facts.weight_bytes
    }

    /// Bytes of the whole KV pool.
    pub fn kv_pool_bytes(&self) -> usize {
        self.facts.num_blocks * self.facts.kv_bytes_per_block
    }

    /// Starts the step's block copies, then every scheduled chunk in one forward pass, on the
    /// device thread; its output holds what the chunks ask for (logits rows, drawn tokens and
    /// hidden rows, in `out.scheduled` order). `adapters` holds every adapter a scheduled
    /// request names; `draws` the sampled requests the device draws itself (only for a backend
    /// whose capabilities say it can); `chained` the chunks whose token the step launched just
    /// before draws (an error if that was not the step launched before, or it drew no such token).
    pub fn launch(
        &mut self,
        out: &SchedulerOutput,
        adapters: &HashMap<AdapterId, AdapterRef>,
        draws: &DeviceDraws,
        chained: Option<Chained>,
    ) -> (LaunchId, Result<PendingForward>) {
        let id = LaunchId(self.next_launch);
        self.next_launch += 1;
        let batch = match self.build_batch(out, adapters, draws) {
            Ok(batch) => batch,
            Err(e) => return (id, Err(e)),
        };
        // Chunk i's token is flat token `query_start` of span i (one span per chunk, in order).
        let inputs: Option<(LaunchId, Vec<(usize, usize)>)> = chained.map(|c| {
            let flat = c
                .inputs
                .iter()
                .map(|&(i, k)| (batch.seqs[i].query_start, k))
                .collect();
            (c.after, flat)
        });
        let copies: Vec<(usize, usize, usize)> = out
            .block_copies
            .iter()
            .map(|c| (c.src.index(), c.dst.index(), c.num_tokens))
            .collect();
        let job = LaunchJob {
            id,
            batch,
            chained: inputs,
            on_device: false,
            copies,
            launches: Arc::clone(&self.launches),
            expects_follower: self.steps_ahead,
        };
        (id, Ok(PendingForward(self.executor.submit_pass(job))))
    }

    /// Runs `spans` in one forward pass: a proposer's own passes over the scheduler's blocks.
    pub fn forward<'a>(
        &mut self,
        spans: impl IntoIterator<Item = Span<'a>>,
    ) -> Result<ForwardOutput> {
        let mut batch = ForwardBatch::default();
        for span in spans {
            self.push(&mut batch, span);
        }
        Ok(self
            .executor
            .call(move |executor| executor.forward(&batch))??)
    }

    /// Appends `span` to `batch`, its block table turned into the slots its KV goes to.
    fn push(&self, batch: &mut ForwardBatch, span: Span<'_>) {
        let slots = slot_mapping(
            span.block_table,
            span.start_position,
            span.token_ids.len(),
            self.facts.block_size,
        );
        let table = span.block_table.iter().map(|b| b.0).collect();
        batch.push_adapted(
            span.token_ids,
            span.start_position,
            slots,
            table,
            span.output,
            span.adapter,
        );
    }

    /// Logits at every prompt position, token by token apart from the pool (a reference).
    pub fn stepwise_prompt_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let tokens = tokens.to_vec();
        Ok(self
            .executor
            .call(move |executor| executor.prompt_logits(&tokens, true))??)
    }

    fn build_batch(
        &self,
        out: &SchedulerOutput,
        adapters: &HashMap<AdapterId, AdapterRef>,
        draws: &DeviceDraws,
    ) -> Result<ForwardBatch> {
        let mut batch = ForwardBatch::default();
        for s in &out.scheduled {
            let output = match s.output {
                ChunkOutput::Nothing => SpanOutput::None,
                ChunkOutput::Sample => match draws.samples.get(&s.request_id) {
                    Some(draw) => SpanOutput::Draw(draw.clone()),
                    None => SpanOutput::LastLogits,
                },
                ChunkOutput::Verify => match draws.verifies.get(&s.request_id) {
                    Some(each) => SpanOutput::DrawEach(each.clone()),
                    None => SpanOutput::AllLogits,
                },
                ChunkOutput::Hidden => SpanOutput::LastHidden,
                ChunkOutput::PromptLogits => SpanOutput::AllLogits,
            };
            let adapter = match s.adapter {
                None => None,
                Some(id) => {
                    Some(
                        adapters
                            .get(&id)
                            .cloned()
                            .ok_or_else(|| EngineError::StepFailed {
                                message: format!(
                                    "{} of {} is not held: this is a bug",
                                    id, s.request_id
                                ),
                            })?,
                    )
                }
            };
            let span = Span {
                token_ids: &s.token_ids,
                start_position: s.start_position,
                block_table: &s.block_table,
                output,
                adapter,
            };
            self.push(&mut batch, span);
        }
        Ok(batch)
    }
}

/// Writes a chained step's inputs into `batch`: `(flat token, k)` gets the `k`-th token drawn
/// by launch `after`, which must be the last forward launched (`last`).
fn fill_chained(
    batch: &mut ForwardBatch,
    last: &(Option<LaunchId>, Vec<u32>),
    after: LaunchId,
    inputs: &[(usize, usize)],
) -> Result<()> {
    let broken = |why: String| EngineError::StepFailed {
        message: format!("a step chained to the one before it: {why}"),
    };
    if last.0 != Some(after) {
        return Err(broken(format!(
            "the last launch was {:?}, not {after:?}",
            last.0
        )));
    }
    for &(flat, k) in inputs {
        let token = *last.1.get(k).ok_or_else(|| {
            broken(format!(
                "{after:?} drew {} tokens, none at {k} (it failed?)",
                last.1.len()
            ))
        })?;
        batch.token_ids[flat] = token;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch_of(tokens: &[u32]) -> ForwardBatch {
        let mut batch = ForwardBatch::default();
        for (i, &t) in tokens.iter().enumerate() {
            batch.push(&[t], i, vec![i], vec![0], true);
        }
        batch
    }

    /// Each pass's tokens and the chained pairs handed with it.
    type PassLog = Arc<Mutex<Vec<(Vec<u32>, Vec<(usize, usize)>)>>>;

    /// An executor whose passes stay on the device until read back, that takes chained inputs
    /// from its own draws there (as the CUDA executor does): it logs each pass's tokens and the
    /// pairs it was handed, and pass `fail_at` fails when read back.
    struct OnDevice {
        config: Qwen2Config,
        log: PassLog,
        fail_at: u64,
        next: u64,
    }

    impl Executor for OnDevice {
        crate::test_support::one_block_cpu_executor!();
        fn copy_block(&mut self, _: usize, _: usize, _: usize) -> novainfer_model::Result<()> {
            Ok(())
        }
        fn forward(&mut self, _: &ForwardBatch) -> novainfer_model::Result<ForwardOutput> {
            unreachable!("passes are enqueued")
        }
        fn embed(&mut self, _: &[u32]) -> novainfer_model::Result<Vec<f32>> {
            Err(novainfer_model::ModelError::EmptyInput)
        }
        fn prompt_logits(&mut self, _: &[u32], _: bool) -> novainfer_model::Result<Vec<f32>> {
            Err(novainfer_model::ModelError::EmptyInput)
        }
        fn chains_on_device(&self, _: &ForwardBatch) -> bool {
            true
        }
        fn enqueue(
            &mut self,
            batch: &ForwardBatch,
            chained: &[(usize, usize)],
        ) -> novainfer_model::Result<Enqueued> {
            let mut log = self.log.lock().expect("lock");
            log.push((batch.token_ids.clone(), chained.to_vec()));
            self.next += 1;
            Ok(Enqueued::InFlight(novainfer_model::PassTicket(
                self.next - 1,
            )))
        }
        fn finish(
            &mut self,
            pass: novainfer_model::PassTicket,
        ) -> novainfer_model::Result<ForwardOutput> {
            if pass.0 == self.fail_at {
                return Err(novainfer_model::ModelError::Cuda("a device fault".into()));
            }
            Ok(ForwardOutput::default())
        }
    }

    fn on_device(fail_at: u64) -> (DeviceThread, LastDrawn, PassLog) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let executor = OnDevice {
            config: crate::test_support::toy_config(8, 16),
            log: log.clone(),
            fail_at,
            next: 0,
        };
        (
            DeviceThread::spawn(Box::new(executor)),
            LastDrawn::default(),
            log,
        )
    }

    fn job(
        id: u64,
        tokens: &[u32],
        chained: Option<(u64, Vec<(usize, usize)>)>,
        launches: &LastDrawn,
    ) -> LaunchJob {
        LaunchJob {
            id: LaunchId(id),
            batch: batch_of(tokens),
            chained: chained.map(|(after, inputs)| (LaunchId(after), inputs)),
            on_device: false,
            copies: Vec::new(),
            launches: Arc::clone(launches),
            expects_follower: true,
        }
    }

    #[test]
    fn a_step_chained_on_the_device_hands_its_pairs_over_with_a_valid_placeholder() {
        let (device, launches, log) = on_device(u64::MAX);
        let first = device.submit_pass(job(0, &[5, 6], None, &launches));
        let pending = novainfer_core::PENDING_TOKEN;
        let second = device.submit_pass(job(
            1,
            &[pending, 7, pending],
            Some((0, vec![(0, 1), (2, 0)])),
            &launches,
        ));
        first.wait().expect("ran").expect("first");
        second.wait().expect("ran").expect("second");
        let log = log.lock().expect("lock").clone();
        assert_eq!(log[1], (vec![0, 7, 0], vec![(0, 1), (2, 0)]));
        // Chained to a pass that was not the last one enqueued: refused before the device.
        let stale = device.submit_pass(job(2, &[pending], Some((0, vec![(0, 0)])), &launches));
        let err = stale.wait().expect("ran").expect_err("stale");
        assert!(
            err.to_string()
                .contains("last pass enqueued was Some(LaunchId(1))"),
            "{err}"
        );
    }

    #[test]
    fn a_step_that_took_its_tokens_from_a_failed_pass_fails_too() {
        let (device, launches, _) = on_device(0);
        let first = device.submit_pass(job(0, &[5], None, &launches));
        let pending = novainfer_core::PENDING_TOKEN;
        let second = device.submit_pass(job(1, &[pending], Some((0, vec![(0, 0)])), &launches));
        let err = first.wait().expect("ran").expect_err("the device fault");
        assert!(err.to_string().contains("a device fault"), "{err}");
        let err = second.wait().expect("ran").expect_err("chained to it");
        assert!(
            err.to_string()
                .contains("LaunchId(0), whose tokens this step took, failed"),
            "{err}"
        );
    }

    #[test]
    fn chained_inputs_take_the_last_launchs_tokens_or_fail_clearly() {
        let last = (Some(LaunchId(4)), vec![70, 71, 72]);
        let mut batch = batch_of(&[0, 9, 0]);
        fill_chained(&mut batch, &last, LaunchId(4), &[(0, 2), (2, 0)]).expect("filled");
        assert_eq!(batch.token_ids, vec![72, 9, 70]);
        // Chained to a launch that is not the last one (another job ran in between).
        let err = fill_chained(&mut batch, &last, LaunchId(3), &[(0, 0)]).expect_err("stale");
        assert!(err.to_string().contains("not LaunchId(3)"), "{err}");
        // The launch before failed (drew nothing).
        let failed = (Some(LaunchId(4)), Vec::new());
        let err = fill_chained(&mut batch, &failed, LaunchId(4), &[(1, 0)]).expect_err("no token");
        assert!(err.to_string().contains("drew 0 tokens"), "{err}");
    }
}
