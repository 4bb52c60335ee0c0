//! What the GPU benches share: opening the GPU (or saying why not and exiting as a skip),
//! timing with CUDA events, and the copy bandwidth their rates are set against.

use std::process::ExitCode;

use novainfer_cuda::cudarc::driver::{sys::CUevent_flags, CudaEvent};
use novainfer_cuda::gpu_test::{when_unavailable_from_env, WhenUnavailable, REQUIRE_GPU_ENV};
use novainfer_cuda::{CudaError, GpuContext};

pub type Error = Box<dyn std::error::Error>;

/// Runs `bench` on GPU 0: without one it prints why and exits 0 (a skip), unless
/// `NOVAINFER_REQUIRE_GPU` is set (then 1); a failure to open the GPU or of the bench exits 1.
pub fn run(name: &str, bench: impl FnOnce(&GpuContext) -> Result<(), Error>) -> ExitCode {
    let gpu = match GpuContext::new(0) {
        Ok(gpu) => gpu,
        Err(CudaError::NotAvailable(why)) => {
            return match when_unavailable_from_env() {
                WhenUnavailable::Skip => {
                    println!("{name} bench: skipped: no CUDA device ({why})");
                    ExitCode::SUCCESS
                }
                WhenUnavailable::Fail => {
                    eprintln!("{name} bench: {REQUIRE_GPU_ENV} is set but no CUDA device is usable: {why}");
                    ExitCode::FAILURE
                }
            };
        }
        Err(e) => {
            eprintln!("{name} bench: opening the GPU failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    match bench(&gpu) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name} bench failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn event(gpu: &GpuContext) -> Result<CudaEvent, Error> {
    Ok(gpu
        .context()
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// Microseconds per call of `f`, from events around `iters` calls after `warmup` more.
pub fn time_us(
    gpu: &GpuContext,
    (warmup, iters): (usize, usize),
    mut f: impl FnMut() -> Result<(), Error>,
) -> Result<f64, Error> {
    for _ in 0..warmup {
        f()?;
    }
    let (start, end) = (event(gpu)?, event(gpu)?);
    start.record(gpu.stream())?;
    for _ in 0..iters {
        f()?;
    }
    end.record(gpu.stream())?;
    Ok(f64::from(start.elapsed_ms(&end)?) * 1e3 / iters as f64)
}

/// Bytes read plus written per second by a 1 GiB device-to-device copy.
pub fn copy_bandwidth(gpu: &GpuContext) -> Result<f64, Error> {
    let n = 1usize << 30;
    let src = gpu.stream().alloc_zeros::<u8>(n)?;
    let mut dst = gpu.stream().alloc_zeros::<u8>(n)?;
    let us = time_us(gpu, (3, 20), || {
        Ok(gpu.stream().memcpy_dtod(&src, &mut dst)?)
    })?;
    Ok(2.0 * n as f64 / (us / 1e6))
}
