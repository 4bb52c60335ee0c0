//! The executor on a thread of its own, so the engine thread can prepare the next step while a
//! forward pass runs (async scheduling), instead of waiting inside it.
//!
//! Jobs run one at a time in the order they were submitted (a block copy before the forward
//! that reads it). Each job's result comes back through a [`Pending`]; a panic inside a job is
//! caught there and resumed on the thread that waits for it, so a broken executor still takes
//! the engine thread down the way it did when the engine called it directly (`handle.rs` then
//! fails every request), rather than leaving a dead device thread behind.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::thread::JoinHandle;

use novainfer_model::Executor;

use crate::error::{EngineError, Result};

type Job = Box<dyn FnOnce(&mut dyn Executor) + Send>;

/// A job's result, or the payload of its panic.
type Outcome<R> = std::result::Result<R, Box<dyn Any + Send>>;

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

impl DeviceThread {
    /// Moves `executor` onto a new thread, which runs jobs until this is dropped.
    pub fn spawn(mut executor: Box<dyn Executor>) -> Self {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("novainfer-device".into())
            .spawn(move || {
                for job in inbox {
                    job(executor.as_mut());
                }
            })
            .expect("spawning the device thread");
        Self {
            jobs: Some(jobs),
            thread: Some(thread),
        }
    }

    /// Runs `f` on the executor after every job submitted before it.
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Executor) -> R + Send + 'static,
    ) -> Pending<R> {
        let (reply, result) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |executor| {
            let outcome = catch_unwind(AssertUnwindSafe(|| f(executor)));
            // The waiter may have given up (its step was abandoned): nothing to tell.
            let _ = reply.send(outcome);
        });
        if let Some(jobs) = &self.jobs {
            // A send fails only if the thread ended; the dropped reply then tells the waiter.
            let _ = jobs.send(job);
        }
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
    use novainfer_model::{
        Capabilities, Device, ForwardBatch, ForwardOutput, ModelError, Qwen2Config,
    };
    use std::sync::{Arc, Mutex};

    /// Records the calls it gets, in order; panics on a copy from block 666.
    struct Log {
        config: Qwen2Config,
        calls: Arc<Mutex<Vec<String>>>,
    }

    impl Executor for Log {
        fn device(&self) -> Device {
            Device::Cpu
        }
        fn config(&self) -> &Qwen2Config {
            &self.config
        }
        fn block_size(&self) -> usize {
            1
        }
        fn num_blocks(&self) -> usize {
            1
        }
        fn kv_bytes_per_block(&self) -> usize {
            1
        }
        fn capabilities(&self) -> Capabilities {
            novainfer_model::capabilities::CPU
        }
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
    }

    fn spawn() -> (DeviceThread, Arc<Mutex<Vec<String>>>) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let config = crate::test_support::toy_config(8, 16);
        let log = Log {
            config,
            calls: calls.clone(),
        };
        (DeviceThread::spawn(Box::new(log)), calls)
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
