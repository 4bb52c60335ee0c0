//! The executor on a thread of its own, so the engine thread can prepare the next step while a
//! forward pass runs (async scheduling), instead of waiting inside it.
//!
//! Jobs run one at a time in the order they were submitted (a block copy before the forward
//! that reads it). Each job's result comes back through a [`Pending`]; a panic inside a job is
//! caught there and resumed on the thread that waits for it, so a broken executor still takes
//! the engine thread down the way it did when the engine called it directly (`handle.rs` then
//! fails every request), rather than leaving a dead device thread behind.
//!
//! A forward pass ([`PassJob`]) runs in two halves: enqueued on the device, then read back.
//! Where the executor leaves a pass on the device ([`Enqueued::InFlight`]) and the job expects
//! another pass behind it, the thread takes the next job before it reads this pass back: the
//! next pass is queued on the device while this one still runs, and the device never waits for
//! the host between them. At most one pass is left in flight; any other job, and a pass whose
//! inputs the host must read from the pass before it, first finishes it.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use novainfer_model::{Enqueued, Executor, ForwardOutput, PassTicket};

use crate::error::{EngineError, Result};

/// How often the thread looks whether an in-flight pass has run while no job is waiting: a
/// bound on how late its result is read back after the device has finished it.
const POLL: Duration = Duration::from_micros(20);

type RunJob = Box<dyn FnOnce(&mut dyn Executor) + Send>;

enum Job {
    /// Runs to completion before the next job.
    Run(RunJob),
    /// A forward pass, which may stay in flight while the next job is taken.
    Pass(Box<dyn ErasedPass>),
}

/// A job's result, or the payload of its panic.
type Outcome<R> = std::result::Result<R, Box<dyn Any + Send>>;

/// A forward pass in the two halves the device thread runs apart.
pub trait PassJob: Send + 'static {
    type Output: Send + 'static;
    /// Whether the pass enqueued before this one must be read back before this one is
    /// enqueued (its drawn tokens are inputs the host fills in).
    fn waits_for_previous(&self, executor: &dyn Executor) -> bool;
    /// Whether another pass is likely to be submitted right behind this one (the engine
    /// schedules ahead): only then is this one left in flight while the thread looks for it.
    fn expects_follower(&self) -> bool;
    /// Enqueues the pass (and whatever must precede it, such as block copies).
    fn enqueue(&mut self, executor: &mut dyn Executor) -> Result<Enqueued>;
    /// The job's result from the pass's output (or the error that stopped it).
    fn finish(self, output: Result<ForwardOutput>) -> Self::Output;
}

/// A [`PassJob`] with its reply channel, its output type erased.
trait ErasedPass: Send {
    fn waits_for_previous(&self, executor: &dyn Executor) -> bool;
    fn expects_follower(&self) -> bool;
    /// Enqueues; the ticket of a pass left on the device (else the outcome is kept).
    fn enqueue(&mut self, executor: &mut dyn Executor) -> Option<PassTicket>;
    /// Reads the pass back (if `ticket`), and replies.
    fn finish(self: Box<Self>, executor: &mut dyn Executor, ticket: Option<PassTicket>);
}

struct PassState<P: PassJob> {
    job: Option<P>,
    /// What enqueueing gave, when it did not leave the pass in flight.
    done: Option<Outcome<Result<ForwardOutput>>>,
    reply: mpsc::SyncSender<Outcome<P::Output>>,
}

impl<P: PassJob> ErasedPass for PassState<P> {
    fn waits_for_previous(&self, executor: &dyn Executor) -> bool {
        self.job
            .as_ref()
            .is_some_and(|j| j.waits_for_previous(executor))
    }

    fn expects_follower(&self) -> bool {
        self.job.as_ref().is_some_and(|j| j.expects_follower())
    }

    fn enqueue(&mut self, executor: &mut dyn Executor) -> Option<PassTicket> {
        let job = self.job.as_mut()?;
        match catch_unwind(AssertUnwindSafe(|| job.enqueue(executor))) {
            Ok(Ok(Enqueued::InFlight(ticket))) => return Some(ticket),
            Ok(Ok(Enqueued::Done(output))) => self.done = Some(Ok(Ok(output))),
            Ok(Err(e)) => self.done = Some(Ok(Err(e))),
            Err(panic) => self.done = Some(Err(panic)),
        }
        None
    }

    fn finish(mut self: Box<Self>, executor: &mut dyn Executor, ticket: Option<PassTicket>) {
        let output = match (ticket, self.done.take()) {
            (Some(ticket), _) => catch_unwind(AssertUnwindSafe(|| {
                executor.finish(ticket).map_err(EngineError::from)
            })),
            (None, Some(done)) => done,
            (None, None) => Ok(Err(EngineError::StepFailed {
                message: "a pass was finished twice: this is a bug".into(),
            })),
        };
        let Some(job) = self.job.take() else {
            return;
        };
        let outcome = match output {
            Ok(output) => catch_unwind(AssertUnwindSafe(|| job.finish(output))),
            Err(panic) => Err(panic),
        };
        // The waiter may have given up (its step was abandoned): nothing to tell.
        let _ = self.reply.send(outcome);
    }
}

pub struct DeviceThread {
    /// `None` once dropping: closing it ends the thread.
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// The result of a submitted job, once it has run.
#[must_use = "a job's result (or its error) is only seen by waiting for it"]
pub struct Pending<R> {
    result: mpsc::Receiver<Outcome<R>>,
}

impl<R> Pending<R> {
    /// Blocks until the job has run. Resumes a panic of the job here.
    pub fn wait(self) -> Result<R> {
        match self.result.recv() {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(panic)) => resume_unwind(panic),
            // Only after an earlier job panicked and its panic was not waited for.
            Err(_) => Err(EngineError::StepFailed {
                message: "the device thread has stopped".into(),
            }),
        }
    }
}

/// The pass left on the device, if any, and its ticket.
type InFlight = Option<(Box<dyn ErasedPass>, PassTicket)>;

fn finish_in_flight(executor: &mut dyn Executor, in_flight: &mut InFlight) {
    if let Some((pass, ticket)) = in_flight.take() {
        pass.finish(executor, Some(ticket));
    }
}

/// The device thread's loop: jobs in order, at most one pass left in flight behind them.
fn serve(executor: &mut dyn Executor, inbox: &mpsc::Receiver<Job>) {
    let mut in_flight: InFlight = None;
    loop {
        let job = match &in_flight {
            None => match inbox.recv() {
                Ok(job) => job,
                Err(_) => return,
            },
            Some((_, ticket)) => match inbox.recv_timeout(POLL) {
                Ok(job) => job,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    // Nothing to queue behind the pass yet: read it back once it has run.
                    if executor.is_done(ticket).unwrap_or(true) {
                        finish_in_flight(executor, &mut in_flight);
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    finish_in_flight(executor, &mut in_flight);
                    return;
                }
            },
        };
        match job {
            Job::Run(f) => {
                finish_in_flight(executor, &mut in_flight);
                f(executor);
            }
            Job::Pass(mut pass) => {
                if pass.waits_for_previous(executor) {
                    finish_in_flight(executor, &mut in_flight);
                }
                let ticket = pass.enqueue(executor);
                // The pass before, now that this one is queued on the device behind it.
                finish_in_flight(executor, &mut in_flight);
                match ticket {
                    Some(ticket) if pass.expects_follower() => in_flight = Some((pass, ticket)),
                    ticket => pass.finish(executor, ticket),
                }
            }
        }
    }
}

impl DeviceThread {
    /// Moves `executor` onto a new thread, which runs jobs until this is dropped.
    pub fn spawn(mut executor: Box<dyn Executor>) -> Self {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("novainfer-device".into())
            .spawn(move || serve(executor.as_mut(), &inbox))
            .expect("spawning the device thread");
        Self {
            jobs: Some(jobs),
            thread: Some(thread),
        }
    }

    fn send(&self, job: Job) {
        if let Some(jobs) = &self.jobs {
            // A send fails only if the thread ended; the dropped reply then tells the waiter.
            let _ = jobs.send(job);
        }
    }

    /// Runs `f` on the executor after every job submitted before it.
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Executor) -> R + Send + 'static,
    ) -> Pending<R> {
        let (reply, result) = mpsc::sync_channel(1);
        self.send(Job::Run(Box::new(move |executor| {
            let outcome = catch_unwind(AssertUnwindSafe(|| f(executor)));
            // The waiter may have given up (its step was abandoned): nothing to tell.
            let _ = reply.send(outcome);
        })));
        Pending { result }
    }

    /// Runs `pass` after every job submitted before it; the next job may be taken before it
    /// is read back (see the module doc).
    pub fn submit_pass<P: PassJob>(&self, pass: P) -> Pending<P::Output> {
        let (reply, result) = mpsc::sync_channel(1);
        self.send(Job::Pass(Box::new(PassState {
            job: Some(pass),
            done: None,
            reply,
        })));
        Pending { result }
    }

    /// [`Self::submit`], waiting for the result.
    pub fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Executor) -> R + Send + 'static,
    ) -> Result<R> {
        self.submit(f).wait()
    }
}

impl Drop for DeviceThread {
    fn drop(&mut self) {
        // Jobs already queued run first: the executor (and its device memory) is freed on its
        // own thread, after the last of them.
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use novainfer_model::{ForwardBatch, ForwardOutput, ModelError, Qwen2Config};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    /// Records the calls it gets, in order; panics on a copy from block 666. Its passes stay in
    /// flight (as a GPU's do) until a later pass is enqueued or `release` is set.
    struct Log {
        config: Qwen2Config,
        calls: Arc<Mutex<Vec<String>>>,
        enqueued: u64,
        release: Arc<AtomicBool>,
    }

    impl Log {
        fn log(&self, call: String) {
            self.calls.lock().expect("lock").push(call);
        }
    }

    impl Executor for Log {
        crate::test_support::one_block_cpu_executor!();
        fn copy_block(&mut self, src: usize, dst: usize, _: usize) -> novainfer_model::Result<()> {
            assert_ne!(src, 666, "a broken executor");
            self.calls
                .lock()
                .expect("lock")
                .push(format!("copy {src} {dst}"));
            Ok(())
        }
        fn forward(&mut self, batch: &ForwardBatch) -> novainfer_model::Result<ForwardOutput> {
            self.calls
                .lock()
                .expect("lock")
                .push(format!("forward {}", batch.token_ids.len()));
            Ok(ForwardOutput::default())
        }
        fn embed(&mut self, _: &[u32]) -> novainfer_model::Result<Vec<f32>> {
            Err(ModelError::EmptyInput)
        }
        fn prompt_logits(&mut self, _: &[u32], _: bool) -> novainfer_model::Result<Vec<f32>> {
            Err(ModelError::EmptyInput)
        }
        fn enqueue(
            &mut self,
            batch: &ForwardBatch,
            _: &[(usize, usize)],
        ) -> novainfer_model::Result<Enqueued> {
            assert_ne!(batch.token_ids.first(), Some(&666), "a broken enqueue");
            let ticket = self.enqueued;
            self.enqueued += 1;
            self.log(format!("enqueue {ticket}"));
            Ok(Enqueued::InFlight(PassTicket(ticket)))
        }
        fn is_done(&mut self, pass: &PassTicket) -> novainfer_model::Result<bool> {
            Ok(pass.0 + 1 < self.enqueued || self.release.load(Ordering::SeqCst))
        }
        fn finish(&mut self, pass: PassTicket) -> novainfer_model::Result<ForwardOutput> {
            self.log(format!("finish {}", pass.0));
            Ok(ForwardOutput::default())
        }
    }

    struct Spawned {
        device: DeviceThread,
        calls: Arc<Mutex<Vec<String>>>,
        release: Arc<AtomicBool>,
    }

    fn spawn() -> (DeviceThread, Arc<Mutex<Vec<String>>>) {
        let s = spawn_log();
        (s.device, s.calls)
    }

    fn spawn_log() -> Spawned {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let release = Arc::new(AtomicBool::new(false));
        let config = crate::test_support::toy_config(8, 16);
        let log = Log {
            config,
            calls: calls.clone(),
            enqueued: 0,
            release: release.clone(),
        };
        Spawned {
            device: DeviceThread::spawn(Box::new(log)),
            calls,
            release,
        }
    }

    /// A pass over one token (666 panics in the executor's enqueue).
    struct Pass {
        token: u32,
        follower: bool,
        waits: bool,
    }

    impl Pass {
        fn new(follower: bool) -> Self {
            Self {
                token: 1,
                follower,
                waits: false,
            }
        }
    }

    impl PassJob for Pass {
        type Output = Result<()>;
        fn waits_for_previous(&self, _: &dyn Executor) -> bool {
            self.waits
        }
        fn expects_follower(&self) -> bool {
            self.follower
        }
        fn enqueue(&mut self, executor: &mut dyn Executor) -> Result<Enqueued> {
            let mut batch = ForwardBatch::default();
            batch.push(&[self.token], 0, vec![0], vec![0], true);
            Ok(executor.enqueue(&batch, &[])?)
        }
        fn finish(self, output: Result<ForwardOutput>) -> Result<()> {
            output.map(|_| ())
        }
    }

    fn calls_of(calls: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
        calls.lock().expect("lock").clone()
    }

    #[test]
    fn the_next_pass_is_enqueued_before_the_one_in_flight_is_read_back() {
        let s = spawn_log();
        let first = s.device.submit_pass(Pass::new(true));
        let second = s.device.submit_pass(Pass::new(true));
        first.wait().expect("ran").expect("first ok");
        // The second stays in flight until the device is done with it.
        s.release.store(true, Ordering::SeqCst);
        second.wait().expect("ran").expect("second ok");
        assert_eq!(
            calls_of(&s.calls),
            ["enqueue 0", "enqueue 1", "finish 0", "finish 1"]
        );
    }

    #[test]
    fn a_pass_no_follower_is_expected_after_is_read_back_at_once() {
        let s = spawn_log();
        s.release.store(true, Ordering::SeqCst);
        s.device
            .submit_pass(Pass::new(false))
            .wait()
            .expect("ran")
            .expect("ok");
        assert_eq!(calls_of(&s.calls), ["enqueue 0", "finish 0"]);
        // Nor does one in flight keep the thread from noticing that it has run.
        s.device
            .submit_pass(Pass::new(true))
            .wait()
            .expect("ran")
            .expect("ok");
        assert_eq!(calls_of(&s.calls)[2..], ["enqueue 1", "finish 1"]);
    }

    #[test]
    fn other_jobs_and_passes_that_wait_read_the_pass_in_flight_back_first() {
        let s = spawn_log();
        let first = s.device.submit_pass(Pass::new(true));
        let waits = s.device.submit_pass(Pass {
            waits: true,
            ..Pass::new(true)
        });
        let copy = s.device.submit(|e| e.copy_block(1, 2, 1));
        s.release.store(true, Ordering::SeqCst);
        first.wait().expect("ran").expect("ok");
        waits.wait().expect("ran").expect("ok");
        copy.wait().expect("ran").expect("ok");
        assert_eq!(
            calls_of(&s.calls),
            ["enqueue 0", "finish 0", "enqueue 1", "finish 1", "copy 1 2"]
        );
    }

    #[test]
    fn a_pass_that_panics_in_enqueue_panics_its_waiter_and_the_one_in_flight_completes() {
        let s = spawn_log();
        let first = s.device.submit_pass(Pass::new(true));
        let broken = s.device.submit_pass(Pass {
            token: 666,
            ..Pass::new(true)
        });
        s.release.store(true, Ordering::SeqCst);
        first
            .wait()
            .expect("ran")
            .expect("the pass in flight completes");
        let caught = catch_unwind(AssertUnwindSafe(|| broken.wait()));
        assert!(caught.is_err(), "the panic reached the waiter");
        assert!(s.device.call(|e| e.copy_block(1, 1, 1)).is_ok());
    }

    #[test]
    fn jobs_run_in_submission_order_while_the_caller_goes_on() {
        let (device, calls) = spawn();
        let copy = device.submit(|e| e.copy_block(1, 2, 1));
        let forward = device.submit(|e| {
            let mut batch = ForwardBatch::default();
            batch.push(&[5, 6, 7], 0, vec![0, 1, 2], vec![0], false);
            e.forward(&batch).map(|_| ())
        });
        let device_name = device
            .call(|e| e.device().to_string())
            .expect("the thread runs");
        assert_eq!(device_name, "cpu");
        forward.wait().expect("ran").expect("forward ok");
        copy.wait().expect("ran").expect("copy ok");
        assert_eq!(
            *calls.lock().expect("lock"),
            vec!["copy 1 2".to_owned(), "forward 3".to_owned()]
        );
    }

    #[test]
    fn submit_returns_while_the_job_runs() {
        let (device, _) = spawn();
        let (go, wait_for_go) = mpsc::channel::<()>();
        // The job can only finish once the caller, after `submit` returned, says so.
        let job = device.submit(move |_| {
            wait_for_go
                .recv_timeout(std::time::Duration::from_secs(30))
                .is_ok()
        });
        go.send(()).expect("the job is waiting");
        assert!(
            job.wait().expect("ran"),
            "the caller went on while the job ran"
        );
    }

    #[test]
    fn a_panicking_job_panics_its_waiter() {
        let (device, _) = spawn();
        let pending = device.submit(|e| e.copy_block(666, 0, 1));
        let caught = catch_unwind(AssertUnwindSafe(|| pending.wait()));
        let payload = caught.expect_err("the panic reached the waiter");
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(message.contains("a broken executor"), "{message}");
        // The thread caught it and goes on.
        assert!(device.call(|e| e.copy_block(1, 1, 1)).is_ok());
    }
}
