//! Host-side helpers of the parity tests: a seeded RNG, upload/download, dtype casts and
//! the tolerance check.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::bf16;
use novainfer_cuda::cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use novainfer_cuda::gemv_plan::GemvWeights;
use novainfer_cuda::ops::dequant::QuantType;
use novainfer_cuda::ops::Dtype;
use novainfer_cuda::GpuContext;

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32() * scale).collect()
    }
}

pub fn up<T: DeviceRepr>(gpu: &GpuContext, host: &[T]) -> CudaSlice<T> {
    gpu.stream().clone_htod(host).expect("upload")
}

pub fn down<T: DeviceRepr + Default + Clone>(gpu: &GpuContext, dev: &CudaSlice<T>) -> Vec<T> {
    gpu.stream().clone_dtoh(dev).expect("download")
}

pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(gpu: &GpuContext, n: usize) -> CudaSlice<T> {
    gpu.stream().alloc_zeros(n).expect("alloc")
}

/// The test's inputs as T (bf16 rounds them) and back to f32 for the CPU oracle.
pub trait TestDtype: Dtype {
    /// Relative tolerance against the f32 CPU oracle computed on the rounded inputs.
    const TOL: f32;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl TestDtype for f32 {
    const TOL: f32 = 2e-5;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl TestDtype for bf16 {
    // One bf16 rounding of the output (2^-8) plus inputs rounded along the way.
    const TOL: f32 = 1.6e-2;
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

pub fn cast<T: TestDtype>(v: &[f32]) -> (Vec<T>, Vec<f32>) {
    let t: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
    let back = t.iter().map(|&x| x.to_f32()).collect();
    (t, back)
}

pub fn assert_close<T: TestDtype>(op: &str, gpu: &[T], cpu: &[f32]) {
    assert_eq!(gpu.len(), cpu.len(), "{op}: length");
    let scale = cpu.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        let g = g.to_f32();
        let err = (g - c).abs();
        assert!(
            err <= T::TOL * c.abs().max(scale * 0.05),
            "{op} [{}]: element {i}: gpu {g} vs cpu {c}",
            T::KIND.suffix()
        );
    }
}

/// `rows` rows of `k` random values in `weights`' format (candle-quantized; int4 by
/// `GroupedInt4`, FP8 by `Fp8Blocks`; bf16 rounded), as the raw bytes the GEMV reads.
pub fn gemv_matrix(weights: GemvWeights, rows: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let values = rng.vec(rows * k, 1.0);
    let ggml = match weights {
        GemvWeights::Bf16 => {
            return values
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect()
        }
        GemvWeights::Packed(QuantType::Int4) => {
            return novainfer_model::int4::GroupedInt4::quantize(rows, k, &values)
                .expect("int4")
                .blocks()
                .to_vec()
        }
        GemvWeights::Packed(QuantType::Fp8) => {
            return novainfer_model::fp8_blocks::Fp8Blocks::quantize_rows("fp8", rows, k, &values)
                .expect("fp8")
                .blocks()
                .to_vec()
        }
        GemvWeights::Packed(QuantType::Q4K) => GgmlDType::Q4K,
        GemvWeights::Packed(QuantType::Q5_0) => GgmlDType::Q5_0,
        GemvWeights::Packed(QuantType::Q6K) => GgmlDType::Q6K,
        GemvWeights::Packed(QuantType::Q8_0) => GgmlDType::Q8_0,
    };
    let t = Tensor::from_vec(values, (rows, k), &Device::Cpu).expect("t");
    let q = QTensor::quantize(&t, ggml).expect("quantize");
    q.data().expect("raw").to_vec()
}
