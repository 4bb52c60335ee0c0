//! cuBLASLt GEMMs with one algorithm a shape, chosen once and cached (opt-in:
//! `NOVAINFER_CUDA_GEMM=lt`, [`crate::gemm_choice`]).
//!
//! `cublasGemmEx` asks its heuristic on every call and may answer a small-`m` shape with a
//! split-K algorithm: a second, reduce kernel a GEMM, and a row's sum cut at points that depend on
//! the configuration. Here the first call of a `(m, n, k, output type)` shape asks cuBLASLt for up
//! to [`CANDIDATES`] algorithms, takes the fastest one without split-K (the fastest of all when
//! none is), and keeps it with its descriptors; every later call of that shape launches it with
//! no heuristic and no allocation (so a CUDA graph may capture it once the shape has run).
//!
//! The operands are the row-major ones of `ops::gemm` seen column-major, as there:
//! `D (n × m, ld n) = op(A) · B` with `A` = W's memory (`k × n`, ld k, transposed), `B` = x's
//! memory (`k × m`, ld k), f32 accumulation, bf16 or f32 `D`.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::context::driver;
use crate::error::{CudaError, Result};

/// Its own workspace, set aside once (NVIDIA's recommendation for Hopper), so no call allocates.
const WORKSPACE_BYTES: usize = 32 << 20;
/// Algorithms asked of the heuristic for a new shape.
pub const CANDIDATES: usize = 8;

/// A GEMM's shape as the cache keys it: `y[m, n] = x[m, k] · W[n, k]ᵀ`, `y` f32 or bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LtShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub f32_out: bool,
}

/// What a shape's calls launch: its descriptors and the chosen algorithm.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are host objects owned by the plan alone, used under the cache's lock.
unsafe impl Send for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created for this plan and is destroyed once, here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// The chosen algorithm of one shape, for the log and the tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LtChoice {
    /// Candidates the heuristic returned.
    pub candidates: usize,
    /// The chosen one's place among them (0: the heuristic's fastest).
    pub rank: usize,
    /// Its split-K factor (1: none).
    pub split_k: u32,
}

pub(crate) struct LtGemms {
    // Field order is drop order: the plans before the handle, the handle before its workspace.
    /// Per shape, its plan, or `None` when none could be made (cuBLAS serves that shape).
    plans: Mutex<HashMap<LtShape, Option<(Plan, LtChoice)>>>,
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
}

// SAFETY: a cuBLASLt handle may be used from any thread (it keeps no per-call state); the plans
// are behind a lock, and the engine drives the context from one thread at a time anyway.
unsafe impl Send for LtGemms {}
unsafe impl Sync for LtGemms {}

fn lt_error(op: &'static str) -> impl Fn(lt::CublasError) -> CudaError {
    move |e| driver(op, e)
}

impl LtGemms {
    /// The caller has probed libcublasLt (`libs::probe_cublas`): cudarc would panic otherwise.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let handle = lt::create_handle().map_err(lt_error("cublasLtCreate"))?;
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| driver("cuMemAlloc", e))?;
        Ok(Self {
            plans: Mutex::new(HashMap::new()),
            handle,
            workspace,
        })
    }

    /// The algorithm chosen for `shape`, once a call has run it.
    pub fn choice(&self, shape: LtShape) -> Option<LtChoice> {
        let plans = self
            .plans
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        plans.get(&shape).and_then(|p| p.as_ref()).map(|(_, c)| *c)
    }

    /// `y = x · Wᵀ` for `shape` on `stream`, with the shape's cached algorithm (chosen now if
    /// this is its first call): `Ok(true)` once enqueued, `Ok(false)` for a shape cuBLASLt has
    /// no plan for (the heuristic failed or found nothing: remembered, and logged once), which
    /// the caller runs with plain cuBLAS instead.
    ///
    /// # Safety
    /// `w`, `x` and `y` address `n·k` bf16, `m·k` bf16 and `m·n` values of `y`'s type (f32 if
    /// `shape.f32_out`, else bf16) of device memory that stays alive until the call has run.
    pub unsafe fn gemm(
        &self,
        stream: &CudaStream,
        shape: LtShape,
        w: u64,
        x: u64,
        y: u64,
    ) -> Result<bool> {
        let handle = self.handle;
        let mut plans = self
            .plans
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let planned = match plans.entry(shape) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(match plan(handle, shape) {
                Ok(planned) => Some(planned),
                Err(error) => {
                    tracing::warn!(?shape, %error, "no cuBLASLt plan for a GEMM shape; cuBLAS runs it");
                    None
                }
            }),
        };
        let Some((plan, _)) = planned else {
            return Ok(false);
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (ws, _ws_sync) = self.workspace.device_ptr(stream);
        // SAFETY: the plan's descriptors are live under the lock, the algorithm came from the
        // heuristic for them, the workspace is this handle's own, and the caller vouches for
        // the operands (this function's contract).
        unsafe {
            lt::matmul(
                handle,
                plan.desc,
                (&alpha as *const f32).cast::<c_void>(),
                (&beta as *const f32).cast::<c_void>(),
                w as *const c_void,
                plan.a,
                x as *const c_void,
                plan.b,
                y as *const c_void,
                plan.d,
                y as *mut c_void,
                plan.d,
                &plan.algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(lt_error("cublasLtMatmul"))?;
        Ok(true)
    }
}

impl Drop for LtGemms {
    fn drop(&mut self) {
        self.plans
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
        // SAFETY: created in `new`, destroyed once, after every plan made with it.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// Which of the heuristic's candidates (fastest first) to take: the first without split-K, else
/// the fastest. The rule the cache applies, apart for the test.
pub fn pick(split_ks: &[u32]) -> Option<usize> {
    if split_ks.is_empty() {
        return None;
    }
    Some(split_ks.iter().position(|&s| s <= 1).unwrap_or(0))
}

/// Descriptors and the chosen algorithm for `shape`.
fn plan(handle: sys::cublasLtHandle_t, shape: LtShape) -> Result<(Plan, LtChoice)> {
    let LtShape { m, n, k, f32_out } = shape;
    let dim = |v: usize| u64::try_from(v).map_err(|_| CudaError::invalid("shape", "too large"));
    let ld = |v: usize| i64::try_from(v).map_err(|_| CudaError::invalid("shape", "too large"));
    let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
    let out = if f32_out {
        sys::cudaDataType_t::CUDA_R_32F
    } else {
        bf16
    };
    let desc = lt::create_matmul_desc(
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cudaDataType_t::CUDA_R_32F,
    )
    .map_err(lt_error("cublasLtMatmulDescCreate"))?;
    // Owned from here: a failure below drops what exists.
    let mut plan = Plan {
        desc,
        a: std::ptr::null_mut(),
        b: std::ptr::null_mut(),
        d: std::ptr::null_mut(),
        // SAFETY: an all-zero algorithm struct is plain data, overwritten before any use.
        algo: unsafe { std::mem::zeroed() },
    };
    let transpose: i32 = 1;
    // SAFETY: the descriptor is live; TRANSA takes a 32-bit cublasOperation_t (1 = T).
    unsafe {
        lt::set_matmul_desc_attribute(
            plan.desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            (&transpose as *const i32).cast::<c_void>(),
            std::mem::size_of::<i32>(),
        )
    }
    .map_err(lt_error("cublasLtMatmulDescSetAttribute"))?;
    plan.a = lt::create_matrix_layout(bf16, dim(k)?, dim(n)?, ld(k)?)
        .map_err(lt_error("cublasLtMatrixLayoutCreate"))?;
    plan.b = lt::create_matrix_layout(bf16, dim(k)?, dim(m)?, ld(k)?)
        .map_err(lt_error("cublasLtMatrixLayoutCreate"))?;
    plan.d = lt::create_matrix_layout(out, dim(n)?, dim(m)?, ld(n)?)
        .map_err(lt_error("cublasLtMatrixLayoutCreate"))?;
    let pref = lt::create_matmul_pref().map_err(lt_error("cublasLtMatmulPreferenceCreate"))?;
    let workspace = WORKSPACE_BYTES as u64;
    // SAFETY: the preference is live; MAX_WORKSPACE_BYTES takes a u64.
    let set = unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&workspace as *const u64).cast::<c_void>(),
            std::mem::size_of::<u64>(),
        )
    };
    // SAFETY: zeroed results are plain data the heuristic overwrites (up to `returned`).
    let mut results: [sys::cublasLtMatmulHeuristicResult_t; CANDIDATES] =
        unsafe { std::mem::zeroed() };
    let mut returned: std::ffi::c_int = 0;
    let asked = set.and_then(|()| {
        // SAFETY: every descriptor is live and `results` holds CANDIDATES entries.
        unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                plan.desc,
                plan.a,
                plan.b,
                plan.d,
                plan.d,
                pref,
                CANDIDATES as std::ffi::c_int,
                results.as_mut_ptr(),
                &mut returned,
            )
            .result()
        }
    });
    // SAFETY: created above, destroyed once.
    unsafe {
        let _ = lt::destroy_matmul_pref(pref);
    }
    asked.map_err(lt_error("cublasLtMatmulAlgoGetHeuristic"))?;
    let usable: Vec<&sys::cublasLtMatmulHeuristicResult_t> = results
        [..usize::try_from(returned).unwrap_or(0).min(CANDIDATES)]
        .iter()
        .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        .collect();
    let split_ks: Vec<u32> = usable
        .iter()
        .map(|r| {
            let mut split: u32 = 1;
            let mut written = 0usize;
            // SAFETY: `algo` is a heuristic result; SPLITK_NUM is a u32.
            let ok = unsafe {
                sys::cublasLtMatmulAlgoConfigGetAttribute(
                    &r.algo,
                    sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                    (&mut split as *mut u32).cast::<c_void>(),
                    std::mem::size_of::<u32>(),
                    &mut written,
                )
            };
            if ok == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                split
            } else {
                u32::MAX
            }
        })
        .collect();
    let Some(rank) = pick(&split_ks) else {
        return Err(driver(
            "cublasLtMatmulAlgoGetHeuristic",
            format!("no algorithm for a {m}x{n}x{k} GEMM"),
        ));
    };
    plan.algo = usable[rank].algo;
    let choice = LtChoice {
        candidates: usable.len(),
        rank,
        split_k: split_ks[rank],
    };
    Ok((plan, choice))
}

#[cfg(test)]
mod tests {
    use super::pick;

    #[test]
    fn the_fastest_candidate_without_split_k_wins_else_the_fastest() {
        assert_eq!(pick(&[4, 1, 1]), Some(1));
        assert_eq!(pick(&[1, 2]), Some(0));
        assert_eq!(pick(&[3, 2]), Some(0));
        assert_eq!(pick(&[]), None);
        // A candidate whose split-K could not be read counts as split.
        assert_eq!(pick(&[u32::MAX, 0]), Some(1));
    }
}
