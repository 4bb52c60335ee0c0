//! The GPU's RoPE table with a checkpoint's scaling against the CPU's `Rope` (`novainfer-model`),
//! both built from `novainfer_cuda::rope_scaling`: the host table is checked here without a GPU,
//! the rotation on a GPU (skipped without one, like `parity.rs`).

#![cfg(feature = "cuda")]

mod common;

use common::host::{assert_close, cast, down, up, Rng, TestDtype};
use half::bf16;
use novainfer_cuda::ops::rope::{host_table, host_table_scaled, rope_neox, RopeHeads, RopeTable};
use novainfer_cuda::ops::DtypeKind;
use novainfer_cuda::{GpuContext, RopeScaling, Yarn};
use novainfer_model::layers::ops as cpu;

const THETA: f64 = 1_000_000.0;

fn scalings() -> [RopeScaling; 4] {
    [
        RopeScaling::None,
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::Dynamic {
            factor: 2.0,
            max_position_embeddings: 1024,
        },
        // Qwen2.5's 128k setup, over a shorter original context so positions pass it.
        RopeScaling::Yarn(Yarn {
            factor: 4.0,
            original_max_position_embeddings: 1024,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: Yarn::default_attention_factor(4.0, None, None),
            truncate: true,
        }),
    ]
}

/// The CPU's (cos, sin) of every pair at `pos`, read back by rotating a head whose lower half is
/// ones and upper half zeros (lo' = 1·cos − 0·sin, hi' = 0·cos + 1·sin: exact).
fn cpu_row(rope: &cpu::Rope, pos: usize, head_dim: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut x: Vec<f32> = (0..head_dim)
        .map(|i| f32::from(u8::from(i < half)))
        .collect();
    rope.apply(&mut x, &[pos], head_dim);
    x
}

#[test]
fn the_gpu_table_is_the_cpu_rotation_bit_for_bit() {
    let hd = 64;
    for scaling in scalings() {
        let table = host_table_scaled(hd, THETA, &scaling, 4096).expect("table");
        let rope = cpu::Rope::scaled(hd, THETA, &scaling);
        for pos in [0usize, 1, 1023, 1024, 4095] {
            let row = &table[pos * hd..(pos + 1) * hd];
            let cpu = cpu_row(&rope, pos, hd);
            assert!(
                row.iter()
                    .zip(&cpu)
                    .all(|(g, c)| g.to_bits() == c.to_bits()),
                "{scaling:?} at {pos}: {row:?} vs {cpu:?}"
            );
        }
    }
    assert_eq!(
        host_table(hd, THETA, 512).expect("plain"),
        host_table_scaled(hd, THETA, &RopeScaling::None, 512).expect("none"),
        "the unscaled table is RopeScaling::None's"
    );
}

fn scaled_rope_body<T: TestDtype>(gpu: &GpuContext, scaling: &RopeScaling) {
    let (n, nh, nkv, hd) = (5, 14, 2, 64);
    let positions = [0usize, 17, 1023, 1500, 4095];
    let mut rng = Rng(11);
    let (q, mut q32) = cast::<T>(&rng.vec(n * nh * hd, 2.0));
    let (k, mut k32) = cast::<T>(&rng.vec(n * nkv * hd, 2.0));
    let table = RopeTable::with_scaling(gpu, hd, THETA, scaling, 4096).expect("table");
    let (mut dq, mut dk) = (up(gpu, &q), up(gpu, &k));
    let pos_i32: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    rope_neox(
        gpu,
        &table,
        &mut dq.as_view_mut(),
        &mut dk.as_view_mut(),
        &up(gpu, &pos_i32).as_view(),
        RopeHeads {
            num_heads: nh,
            num_kv_heads: nkv,
        },
    )
    .expect("launch");
    let rope = cpu::Rope::scaled(hd, THETA, scaling);
    rope.apply(&mut q32, &positions, hd);
    rope.apply(&mut k32, &positions, hd);
    let (gq, gk) = (down(gpu, &dq), down(gpu, &dk));
    if T::KIND == DtypeKind::F32 {
        for (name, g, c) in [("q", &gq, &q32), ("k", &gk, &k32)] {
            assert!(
                g.iter()
                    .zip(c)
                    .all(|(g, c)| g.to_f32().to_bits() == c.to_bits()),
                "{scaling:?}: rope {name}"
            );
        }
    } else {
        assert_close("scaled rope q", &gq, &q32);
        assert_close("scaled rope k", &gk, &k32);
    }
}

#[test]
fn scaled_rope_matches_cpu() {
    let Some(gpu) = common::gpu_or_skip("scaled rope") else {
        return;
    };
    for scaling in scalings() {
        scaled_rope_body::<f32>(&gpu, &scaling);
        scaled_rope_body::<bf16>(&gpu, &scaling);
    }
}
