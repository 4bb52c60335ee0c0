//! The cuBLASLt GEMMs (`NOVAINFER_CUDA_GEMM=lt`, `blas_lt.rs`) against `cublasGemmEx` on the same
//! inputs: the decode and prefill shapes of a 1.5B layer, bf16 and f32 outputs, within the
//! summation-order noise of two f32 accumulations of bf16 products; a shape's algorithm is chosen
//! once (the same choice after a second call) and reported. Fresh random inputs every run.
//! A module of the `parity` binary.

use crate::common;
use crate::common::host::{down, up, Rng};
use half::bf16;
use novainfer_cuda::blas_lt::LtShape;
use novainfer_cuda::gemm_choice::GemmLibrary;
use novainfer_cuda::ops::gemm::{gemm_bf16, gemm_bf16_f32out, GemmShape};
use novainfer_cuda::GpuContext;

fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

fn bf16s(rng: &mut Rng, n: usize) -> Vec<bf16> {
    rng.vec(n, 1.0).into_iter().map(bf16::from_f32).collect()
}

/// Worst |a − b| over the largest |b|.
fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn cublaslt_gemms_follow_cublas_and_keep_one_algorithm_a_shape() {
    let Some(plain) = common::gpu_or_skip("cublaslt") else {
        return;
    };
    let lt = GpuContext::with_gemm_library(0, GemmLibrary::CublasLt).expect("a cuBLASLt context");
    let seed = seed();
    println!("cublaslt: seed {seed}");
    let mut rng = Rng(seed);
    // (m, n, k): batched decode of the down projection, a prefill chunk of gate_up, the LM head.
    for (m, n, k) in [
        (16, 1536, 8960),
        (64, 1536, 8960),
        (512, 17920, 1536),
        (9, 4096, 1536),
    ] {
        let (x, w) = (bf16s(&mut rng, m * k), bf16s(&mut rng, n * k));
        let shape = GemmShape { m, n, k };
        let mut results = Vec::new();
        for gpu in [&plain, &lt] {
            let (xd, wd) = (up(gpu, &x), up(gpu, &w));
            let mut y16 = up(gpu, &vec![bf16::ZERO; m * n]);
            let mut y32 = up(gpu, &vec![0f32; m * n]);
            let (xv, wv) = (xd.as_view(), wd.as_view());
            gemm_bf16(gpu, &xv, &wv, shape, &mut y16.as_view_mut()).expect("bf16 out");
            gemm_bf16_f32out(gpu, &xv, &wv, shape, &mut y32.as_view_mut()).expect("f32 out");
            let y16: Vec<f32> = down(gpu, &y16).iter().map(|v| v.to_f32()).collect();
            results.push((y16, down(gpu, &y32)));
        }
        let (e16, e32) = (
            rel(&results[1].0, &results[0].0),
            rel(&results[1].1, &results[0].1),
        );
        let key = |f32_out| LtShape { m, n, k, f32_out };
        let choice = lt
            .lt_choice(key(true))
            .expect("a plan for the shape that ran");
        println!("cublaslt {m}x{n}x{k}: rel err bf16 {e16:.2e}, f32 {e32:.2e}; {choice:?}");
        assert!(e32 < 1e-4, "{m}x{n}x{k}: f32 out differs by {e32}");
        assert!(e16 < 1e-2, "{m}x{n}x{k}: bf16 out differs by {e16}");
        assert!(
            plain.lt_choice(key(true)).is_none(),
            "no plans without cuBLASLt"
        );
        // A second call runs the same plan.
        let (xd, wd) = (up(&lt, &x), up(&lt, &w));
        let mut y32 = up(&lt, &vec![0f32; m * n]);
        gemm_bf16_f32out(
            &lt,
            &xd.as_view(),
            &wd.as_view(),
            shape,
            &mut y32.as_view_mut(),
        )
        .expect("again");
        assert_eq!(lt.lt_choice(key(true)), Some(choice));
        assert_eq!(
            down(&lt, &y32),
            results[1].1,
            "the same plan, the same bits"
        );
    }
}
