//! Every kernel entry point, looked up once when the context opens.
//!
//! Launchers index this table by field and by `T: Dtype` (a `match` on a constant), so a
//! launch never formats a name, takes a lock or compiles anything. The names come from
//! [`crate::kernels`], the same list the NVRTC test finds in every compiled binary.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use crate::cache::KernelCache;
use crate::context::{cached_cubin, driver_named};
use crate::error::Result;
use crate::gemv_plan::{GemvEpilogue, GemvFamily};
use crate::kernels::{self, attention_entry, dtyped_entry, DtypeKind, KernelSource, KERNELS};
use crate::ops::dequant::QuantType;
use crate::ops::{Dtype, PerDtype};

/// The attention kernels of one (dtype, head_dim).
#[derive(Debug)]
pub(crate) struct AttentionFns {
    pub decode: CudaFunction,
    pub decode_grouped: CudaFunction,
    pub merge: CudaFunction,
    pub prefill: CudaFunction,
}

/// Attention kernels by dtype and head dim (slot i ⇔ `ATTENTION_DIMS[i]`).
const ATTENTION_DIMS: [usize; 3] = [64, 128, 256];

#[derive(Debug)]
pub(crate) struct KernelTable {
    pub embedding: PerDtype<CudaFunction>,
    pub rms_norm: PerDtype<CudaFunction>,
    pub add_rms_norm: PerDtype<CudaFunction>,
    pub rope: PerDtype<CudaFunction>,
    pub reshape_and_cache: PerDtype<CudaFunction>,
    pub silu_mul: PerDtype<CudaFunction>,
    pub argmax: PerDtype<CudaFunction>,
    pub sample: PerDtype<CudaFunction>,
    pub draw: PerDtype<CudaFunction>,
    pub adjust_rows: PerDtype<CudaFunction>,
    pub mask_rows: PerDtype<CudaFunction>,
    pub qkv: PerDtype<CudaFunction>,
    pub gather: PerDtype<CudaFunction>,
    pub gather_columns: PerDtype<CudaFunction>,
    pub chain_tokens: CudaFunction,
    pub lora_shrink: PerDtype<CudaFunction>,
    pub lora_expand: PerDtype<CudaFunction>,
    /// Indexed by [`QuantType::index`].
    pub dequant: [PerDtype<CudaFunction>; QuantType::ALL.len()],
    /// Indexed by [`QuantType::index`]: token rows of a packed table.
    pub embed: [PerDtype<CudaFunction>; QuantType::ALL.len()],
    /// Indexed by [`GemvEpilogue::index`] then [`GemvFamily::index`]; by output dtype (the input
    /// is bf16).
    gemv: [[PerDtype<CudaFunction>; 2]; 3],
    /// The tiled GEMM over packed weights (`gemv_quant.cu`'s `gemm_packed_*`), and the sum of
    /// its k ranges when split.
    pub gemm_packed: PerDtype<CudaFunction>,
    pub gemm_packed_reduce: PerDtype<CudaFunction>,
    attention: PerDtype<[Option<AttentionFns>; 3]>,
    /// `flash_prefill_bf16_hd<d>` for d in [`kernels::FLASH_PREFILL_HEAD_DIMS`], in order.
    flash_prefill: [CudaFunction; 2],
}

impl KernelTable {
    /// Loads every module (compiling what the disk cache lacks) and looks up every entry.
    pub fn load(ctx: &Arc<CudaContext>, cache: &KernelCache, arch: &str) -> Result<Self> {
        let loader = Loader::new(ctx, cache, arch)?;
        let per = |kernel: &KernelSource, base: &str| -> Result<PerDtype<CudaFunction>> {
            Ok(PerDtype {
                f32: loader.get(kernel, &dtyped_entry(base, DtypeKind::F32))?,
                bf16: loader.get(kernel, &dtyped_entry(base, DtypeKind::Bf16))?,
            })
        };
        let dequant = |q: QuantType| per(&kernels::DEQUANT, q.kernel_base());
        let gemv = |e: GemvEpilogue| -> Result<[PerDtype<CudaFunction>; 2]> {
            let [packed, bf16] = GemvFamily::ALL;
            Ok([
                per(&kernels::GEMV_QUANT, &packed.entry_base(e))?,
                per(&kernels::GEMV_QUANT, &bf16.entry_base(e))?,
            ])
        };
        let embed = |q: QuantType| per(&kernels::DEQUANT, q.embed_base());
        Ok(Self {
            embedding: per(&kernels::EMBEDDING, "embedding_gather")?,
            rms_norm: per(&kernels::RMS_NORM, "rms_norm")?,
            add_rms_norm: per(&kernels::RMS_NORM, "add_rms_norm")?,
            rope: per(&kernels::ROPE, "rope_neox")?,
            reshape_and_cache: per(&kernels::RESHAPE_AND_CACHE, "reshape_and_cache")?,
            silu_mul: per(&kernels::SILU_MUL, "silu_mul")?,
            argmax: per(&kernels::SAMPLING, "argmax")?,
            sample: per(&kernels::SAMPLING, "sample")?,
            draw: per(&kernels::SAMPLING, "draw")?,
            adjust_rows: per(&kernels::SAMPLING, "adjust_rows")?,
            mask_rows: per(&kernels::SAMPLING, "mask_rows")?,
            qkv: per(&kernels::QKV, "qkv_bias_rope_cache")?,
            gather: per(&kernels::GATHER, "gather_rows")?,
            gather_columns: per(&kernels::GATHER, "gather_columns")?,
            chain_tokens: loader.get(&kernels::GATHER, "chain_tokens")?,
            lora_shrink: per(&kernels::LORA, "lora_shrink")?,
            lora_expand: per(&kernels::LORA, "lora_expand")?,
            dequant: [
                dequant(QuantType::ALL[0])?,
                dequant(QuantType::ALL[1])?,
                dequant(QuantType::ALL[2])?,
                dequant(QuantType::ALL[3])?,
                dequant(QuantType::ALL[4])?,
                dequant(QuantType::ALL[5])?,
            ],
            embed: [
                embed(QuantType::ALL[0])?,
                embed(QuantType::ALL[1])?,
                embed(QuantType::ALL[2])?,
                embed(QuantType::ALL[3])?,
                embed(QuantType::ALL[4])?,
                embed(QuantType::ALL[5])?,
            ],
            gemm_packed: per(&kernels::GEMV_QUANT, "gemm_packed")?,
            gemm_packed_reduce: per(&kernels::GEMV_QUANT, "gemm_packed_reduce")?,
            gemv: [
                gemv(GemvEpilogue::ALL[0])?,
                gemv(GemvEpilogue::ALL[1])?,
                gemv(GemvEpilogue::ALL[2])?,
            ],
            attention: PerDtype {
                f32: loader.attention(DtypeKind::F32)?,
                bf16: loader.attention(DtypeKind::Bf16)?,
            },
            flash_prefill: [
                loader.get(
                    &kernels::FLASH_PREFILL,
                    &kernels::flash_prefill_entry(kernels::FLASH_PREFILL_HEAD_DIMS[0]),
                )?,
                loader.get(
                    &kernels::FLASH_PREFILL,
                    &kernels::flash_prefill_entry(kernels::FLASH_PREFILL_HEAD_DIMS[1]),
                )?,
            ],
        })
    }

    /// The attention kernels for `T` and `head_dim`, if that pair is instantiated.
    pub fn attention<T: Dtype>(&self, head_dim: usize) -> Option<&AttentionFns> {
        let slot = ATTENTION_DIMS.iter().position(|&d| d == head_dim)?;
        self.attention.get::<T>()[slot].as_ref()
    }

    /// The GEMV with `epilogue` for `family`'s runs (a launch names its runs' formats).
    pub fn gemv(&self, epilogue: GemvEpilogue, family: GemvFamily) -> &PerDtype<CudaFunction> {
        &self.gemv[epilogue.index()][family.index()]
    }

    /// The tensor-core prefill kernel for `head_dim` (bf16 only), if instantiated.
    pub fn flash_prefill(&self, head_dim: usize) -> Option<&CudaFunction> {
        let slot = kernels::FLASH_PREFILL_HEAD_DIMS
            .iter()
            .position(|&d| d == head_dim)?;
        Some(&self.flash_prefill[slot])
    }
}

/// The loaded modules, by kernel name; only alive while the table is built.
struct Loader {
    modules: HashMap<&'static str, Arc<CudaModule>>,
}

impl Loader {
    fn new(ctx: &Arc<CudaContext>, cache: &KernelCache, arch: &str) -> Result<Self> {
        let mut modules = HashMap::new();
        for kernel in KERNELS {
            let cubin = cached_cubin(cache, kernel, arch)?;
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(|e| driver_named("cuModuleLoadData", kernel.name, e))?;
            modules.insert(kernel.name, module);
        }
        Ok(Self { modules })
    }

    fn get(&self, kernel: &KernelSource, name: &str) -> Result<CudaFunction> {
        let module = self
            .modules
            .get(kernel.name)
            .ok_or_else(|| driver_named("cuModuleLoadData", kernel.name, "module not loaded"))?;
        module
            .load_function(name)
            .map_err(|e| driver_named("cuModuleGetFunction", name, e))
    }

    fn attention(&self, dtype: DtypeKind) -> Result<[Option<AttentionFns>; 3]> {
        let mut out: [Option<AttentionFns>; 3] = [None, None, None];
        for (slot, &hd) in ATTENTION_DIMS.iter().enumerate() {
            if !dtype.attention_head_dims().contains(&hd) {
                continue;
            }
            let get = |phase: &str| {
                self.get(
                    &kernels::PAGED_ATTENTION,
                    &attention_entry(phase, dtype, hd),
                )
            };
            out[slot] = Some(AttentionFns {
                decode: get("decode")?,
                decode_grouped: get("decode_grouped")?,
                merge: get("merge")?,
                prefill: get("prefill")?,
            });
        }
        Ok(out)
    }
}
