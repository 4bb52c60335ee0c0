//! Runs the CUDA kernels' own source (`kernels/*.cu`) on the CPU.
//!
//! The CUDA tests need a GPU; CPU twins check a kernel's index arithmetic but not the kernel.
//! This crate compiles every kernel file as C++ against `cuemu/cuemu.h` (a thread per GPU
//! thread as a fiber, barriers for `__syncthreads` and warp collectives, `ldmatrix`
//! and `mma.sync` in the PTX ISA's fragment layouts) so tests can launch the real kernels on host memory and
//! compare them with the CPU references, and a divergent barrier or a shuffle over a lane
//! that left fails the launch instead of corrupting a GPU run. It is a test tool: slow
//! (a context switch per wait, launches serialised) and silent about performance.
//!
//! Launch a kernel by calling its `extern "C"` symbol (declared in [`kernels`]) inside the
//! closure given to [`launch`]; every emulated thread runs the closure.

pub mod kernels;

use std::ffi::{c_char, c_int, c_void, CStr};

/// A launch's grid or block extent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dim3 {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}

impl Dim3 {
    pub const fn x(x: u32) -> Self {
        Dim3 { x, y: 1, z: 1 }
    }
    pub const fn xy(x: u32, y: u32) -> Self {
        Dim3 { x, y, z: 1 }
    }
}

/// Why an emulated launch failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchError(pub String);

impl std::fmt::Display for LaunchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "emulated launch failed: {}", self.0)
    }
}

impl std::error::Error for LaunchError {}

extern "C-unwind" {
    fn cuemu_launch(
        grid: *const u32,
        block: *const u32,
        body: extern "C-unwind" fn(*mut c_void),
        ctx: *mut c_void,
        schedule: c_int,
        seed: u64,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
}

extern "C-unwind" fn trampoline<F: Fn() + Sync>(ctx: *mut c_void) {
    // SAFETY: `launch` passes a `&F` that outlives the launch.
    let body = unsafe { &*(ctx as *const F) };
    body();
}

/// The order in which a block's threads run between their waits. A GPU promises none, so a
/// kernel that reads another thread's shared-memory write without a barrier between them is
/// wrong; under one order it may still pass, under another it does not. [`launch`] takes the
/// order from `CUEMU_SCHEDULE` (`forward`, `reverse`, `shuffle` or `shuffle:SEED`; forward by
/// default), so the whole suite can run under each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Thread order, every round.
    Forward,
    /// Reverse thread order, every round.
    Reverse,
    /// A new permutation every round, from this seed.
    Shuffle(u64),
}

/// The environment variable [`launch`] reads its [`Schedule`] from.
pub const SCHEDULE_ENV: &str = "CUEMU_SCHEDULE";

impl Schedule {
    /// Parses `forward`, `reverse`, `shuffle` (seed 1) or `shuffle:SEED`.
    pub fn parse(value: &str) -> Result<Self, LaunchError> {
        match value.trim() {
            "" | "forward" => Ok(Schedule::Forward),
            "reverse" => Ok(Schedule::Reverse),
            "shuffle" => Ok(Schedule::Shuffle(1)),
            other => other
                .strip_prefix("shuffle:")
                .and_then(|seed| seed.parse().ok())
                .map(Schedule::Shuffle)
                .ok_or_else(|| {
                    LaunchError(format!(
                        "{SCHEDULE_ENV}={other:?}: expected forward, reverse, shuffle or shuffle:SEED"
                    ))
                }),
        }
    }

    /// `CUEMU_SCHEDULE`'s order (forward when unset).
    pub fn from_env() -> Result<Self, LaunchError> {
        Self::parse(&std::env::var(SCHEDULE_ENV).unwrap_or_default())
    }
}

/// Runs `body` as every thread of a `grid` × `block` launch (blocks in order, the threads of
/// a block as fibers on the calling thread), in `CUEMU_SCHEDULE`'s order. `body` calls one
/// kernel; the emulator's collectives may unwind through it when the launch fails (a C++
/// exception, hence the "C-unwind" ABI).
pub fn launch<F: Fn() + Sync>(grid: Dim3, block: Dim3, body: F) -> Result<(), LaunchError> {
    launch_with(Schedule::from_env()?, grid, block, body)
}

/// [`launch`] in a given order.
pub fn launch_with<F: Fn() + Sync>(
    schedule: Schedule,
    grid: Dim3,
    block: Dim3,
    body: F,
) -> Result<(), LaunchError> {
    let (kind, seed) = match schedule {
        Schedule::Forward => (0, 0),
        Schedule::Reverse => (1, 0),
        Schedule::Shuffle(seed) => (2, seed),
    };
    let grid = [grid.x, grid.y, grid.z];
    let block = [block.x, block.y, block.z];
    let mut error = [0 as c_char; 512];
    // SAFETY: the arrays and `body` live across the call, which joins every thread before
    // returning; `error` is NUL-terminated by snprintf within its length.
    let rc = unsafe {
        cuemu_launch(
            grid.as_ptr(),
            block.as_ptr(),
            trampoline::<F>,
            &body as *const F as *mut c_void,
            kind,
            seed,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        // SAFETY: see above.
        let why = unsafe { CStr::from_ptr(error.as_ptr()) };
        Err(LaunchError(why.to_string_lossy().into_owned()))
    }
}
