//! What a backend can do. The engine asks these instead of comparing devices, so a new
//! backend (another GPU kind, tensor parallelism) states its abilities in one place and the
//! engine's decisions follow.
//!
//! The capabilities of a device kind are known before anything is loaded ([`Capabilities::of`]):
//! the engine decides at start-up whether an option runs there (or moves `auto` to the CPU),
//! and an [`Executor`](crate::Executor) reports the same table once running.

use crate::device::Device;
use crate::kv_dtype::{KvCacheDtype, KvStorage};
use crate::lm_head_dtype::LmHeadDtype;

/// What one backend supports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capabilities {
    /// The KV storage formats its pool holds; the first is what `kv_cache_dtype="auto"` gives.
    pub kv_dtypes: &'static [KvStorage],
    /// The `lm_head_dtype` choices it honours.
    pub lm_head_dtypes: &'static [LmHeadDtype],
    /// Whether it runs the SLOT layout (a pool of one-token cells with no prefix cache).
    pub slot_layout: bool,
    /// How many distinct LoRA adapters one step may use (0: spans with an adapter do not
    /// run here).
    pub adapters: usize,
    /// Weights and KV pool live in host memory: the KV budget is a byte count of host memory
    /// (`kv_cache_bytes`, not a fraction of device memory) and the step defaults follow the
    /// host's cores.
    pub host_memory: bool,
    /// Which rows it samples itself ([`SpanOutput::Draw`](crate::SpanOutput::Draw)); a row it
    /// cannot draw comes back as logits for the engine's sampler.
    pub sampling: DeviceSampling,
    /// Most rows (decodes plus draft tokens) a decode step should verify. A step reads every
    /// weight once whatever its rows; while that read dominates, extra rows are almost free
    /// and drafts pay, past it they cost what they save.
    pub verify_rows: usize,
    /// What one more row of a step costs relative to the step's fixed part, assumed until the
    /// engine has timed steps of several sizes.
    pub assumed_row_share: f64,
}

/// What a backend's forward can sample on the device, so that a step returns token ids
/// instead of logits rows. Anything not listed stays with the engine's sampler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceSampling {
    /// Greedy rows and seeded temperature / top-k / top-p / min-p draws
    /// ([`Draw`](crate::Draw)), each row with its chosen token's raw logprob.
    pub draws: bool,
}

/// LoRA adapters the CUDA executor holds on the device at once (`cuda/lora.rs`).
pub const CUDA_ADAPTER_SLOTS: usize = 32;

/// The CPU executor: every option, sampling left to the engine (its sampler runs on the same
/// memory, so a device sampler would gain nothing).
pub const CPU: Capabilities = Capabilities {
    kv_dtypes: &[
        KvStorage::F16,
        KvStorage::F32,
        KvStorage::Bf16,
        KvStorage::Q8_0,
    ],
    lm_head_dtypes: &[LmHeadDtype::Auto, LmHeadDtype::Q8_0],
    slot_layout: true,
    // Adapters stay in host memory, read in place.
    adapters: usize::MAX,
    host_memory: true,
    sampling: DeviceSampling { draws: false },
    // 16 rows of the 0.5B model cost ~5× one row on 2 cores (docs/benchmarks.md).
    verify_rows: 8,
    // ~0.36 a row, from the same measurement.
    assumed_row_share: 0.3,
};

/// The CUDA executor: a bf16 block pool, draws on the device, LoRA adapters copied to the
/// device on first use (`cuda/lora.rs`).
pub const CUDA: Capabilities = Capabilities {
    kv_dtypes: &[KvStorage::Bf16],
    // The device holds every dense matrix in bf16 (`prepare`); no Q8_0 GEMM there yet.
    lm_head_dtypes: &[LmHeadDtype::Auto],
    slot_layout: false,
    adapters: CUDA_ADAPTER_SLOTS,
    host_memory: false,
    sampling: DeviceSampling { draws: true },
    // Estimates (not yet measured): a GPU stays bandwidth-bound over many more rows.
    verify_rows: 64,
    assumed_row_share: 0.01,
};

impl Capabilities {
    /// The capabilities of the backend that runs `device` (known before loading).
    pub fn of(device: Device) -> Self {
        match device {
            Device::Cpu => CPU,
            Device::Cuda(_) => CUDA,
        }
    }

    /// The storage a `kv_cache_dtype` choice gives here, or `None` when this backend cannot
    /// hold it.
    pub fn kv_storage(&self, choice: KvCacheDtype) -> Option<KvStorage> {
        match choice {
            KvCacheDtype::Auto => self.kv_dtypes.first().copied(),
            KvCacheDtype::Fixed(s) => self.kv_dtypes.contains(&s).then_some(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_kv_storage_is_each_backends_first() {
        // The CPU's auto is f16 (`KvCacheDtype::for_cpu`); the GPU pool is bf16 only.
        assert_eq!(
            CPU.kv_storage(KvCacheDtype::Auto),
            Some(KvCacheDtype::Auto.for_cpu())
        );
        assert_eq!(CUDA.kv_storage(KvCacheDtype::Auto), Some(KvStorage::Bf16));
        assert_eq!(CUDA.kv_storage(KvCacheDtype::Fixed(KvStorage::Q8_0)), None);
        for s in [
            KvStorage::F32,
            KvStorage::F16,
            KvStorage::Bf16,
            KvStorage::Q8_0,
        ] {
            assert_eq!(CPU.kv_storage(KvCacheDtype::Fixed(s)), Some(s));
        }
    }

    #[test]
    fn the_cpu_samples_nothing_itself() {
        assert!(!Capabilities::of(Device::Cpu).sampling.draws);
        assert!(Capabilities::of(Device::Cuda(1)).sampling.draws);
    }
}
