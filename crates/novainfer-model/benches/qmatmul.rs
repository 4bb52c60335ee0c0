//! Our packed quantized matmuls against candle's `QMatMul` on the same GGUF-quantized weights,
//! in the shapes of Qwen2.5-Coder-1.5B's Q6_K tensors (the Q4_K_M mix keeps `ffn_down` of half the
//! layers, `attn_v` of half the layers and `output` in Q6_K) and its Q4_K `ffn_gate`/`ffn_up`,
//! `attn_q` and `ffn_down`:
//! decode (m = 1), a decode verifying 4 drafts (m = 5; 2 and 8 for two streaming shapes) and prefill chunks (m = 64, 512); plus decode over matrices past the
//! last-level cache in Q4_K, Q5_0 and Q8_0 (the `stream` shapes). Both run on candle's barrier pool, so
//! `RAYON_NUM_THREADS=1` compares them per core. Times are the calling thread's CPU time
//! (see `common/cpu_time.rs`), so they mean per-core cost only with one thread.
//!
//! `RAYON_NUM_THREADS=1 cargo bench -p novainfer-model --bench qmatmul`
//! (`NOVAINFER_QMATMUL_ISA=avx2` pins our AVX2 path on a CPU with AVX-512 or AVX-VNNI).

#[path = "common/cpu_time.rs"]
mod cpu_time;

use std::hint::black_box;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use novainfer_model::layers::qmatmul::PackedMatrix;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use cpu_time::ThreadCpuTime;

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

struct Shape {
    name: &'static str,
    dtype: GgmlDType,
    n: usize,
    k: usize,
    ms: &'static [usize],
}

const SHAPES: &[Shape] = &[
    Shape {
        name: "q6k_ffn_down_1536x8960",
        dtype: GgmlDType::Q6K,
        n: 1536,
        k: 8960,
        ms: &[1, 64, 512],
    },
    Shape {
        name: "q6k_attn_v_256x1536",
        dtype: GgmlDType::Q6K,
        n: 256,
        k: 1536,
        ms: &[1, 5, 512],
    },
    // `output` is 151936 x 1536; a 64k-row slice is past the last-level cache like the
    // whole one, so decode streams it from memory the same way.
    Shape {
        name: "q6k_output_65536x1536",
        dtype: GgmlDType::Q6K,
        n: 65536,
        k: 1536,
        ms: &[1, 5],
    },
    Shape {
        name: "q4k_ffn_up_8960x1536",
        dtype: GgmlDType::Q4K,
        n: 8960,
        k: 1536,
        ms: &[1, 5, 512],
    },
    // The rest of the 1.5B model's Q4_K matrices in prefill: `attn_q` (and `attn_output`, same
    // shape) and the Q4_K half of `ffn_down`.
    Shape {
        name: "q4k_attn_q_1536x1536",
        dtype: GgmlDType::Q4K,
        n: 1536,
        k: 1536,
        ms: &[512],
    },
    Shape {
        name: "q4k_ffn_down_1536x8960",
        dtype: GgmlDType::Q4K,
        n: 1536,
        k: 8960,
        ms: &[512],
    },
    // In a real decode step every matrix streams from memory (the 1.5B model's 1.1 GB is far
    // past the last-level cache); the 8960-row `ffn_up` above stays in L3 across iterations,
    // so this past-the-cache Q4_K matrix of the same k stands for the streaming case.
    Shape {
        name: "q4k_stream_65536x1536",
        dtype: GgmlDType::Q4K,
        n: 65536,
        k: 1536,
        ms: &[1, 2, 5, 8],
    },
    // The 0.5B model's Q5_0 and Q8_0 matrices (k = 896), streaming the same way.
    Shape {
        name: "q5_0_stream_65536x896",
        dtype: GgmlDType::Q5_0,
        n: 65536,
        k: 896,
        ms: &[1, 2, 5, 8],
    },
    Shape {
        name: "q8_0_stream_65536x896",
        dtype: GgmlDType::Q8_0,
        n: 65536,
        k: 896,
        ms: &[1, 5],
    },
];

fn qmatmul(c: &mut Criterion<ThreadCpuTime>) {
    for shape in SHAPES {
        let (n, k) = (shape.n, shape.k);
        let w = Tensor::from_vec(random(n * k, 7), (n, k), &Device::Cpu).expect("w");
        let q = QTensor::quantize(&w, shape.dtype).expect("quantize");
        let ours = PackedMatrix::from_qtensor(&q)
            .expect("pack")
            .expect("this CPU has no AVX2: nothing to compare");
        let theirs = QMatMul::from_qtensor(q).expect("qmatmul");
        let mut group = c.benchmark_group(shape.name);
        group.sample_size(10);
        for &m in shape.ms {
            let x = random(m * k, 1000 + m as u64);
            let xt = Tensor::from_slice(&x, (m, k), &Device::Cpu).expect("x");
            group.throughput(Throughput::Elements((m * n * k) as u64));
            group.bench_function(BenchmarkId::new("ours", m), |b| {
                b.iter(|| black_box(ours.matmul(black_box(&x), m)))
            });
            group.bench_function(BenchmarkId::new("candle", m), |b| {
                b.iter(|| black_box(theirs.forward(black_box(&xt)).expect("candle")))
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(ThreadCpuTime);
    targets = qmatmul
}
criterion_main!(benches);
