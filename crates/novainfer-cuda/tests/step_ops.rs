//! CPU ↔ CUDA parity of the ops the model's CUDA forward adds around the kernels of
//! `parity.rs`: the cuBLAS GEMM, the fused bias + RoPE + KV write, row gathering and block
//! copies. Buffers are passed as the first rows of larger, preallocated ones, as the forward
//! does. Each test skips without a GPU (fails under `NOVAINFER_REQUIRE_GPU`).

#![cfg(feature = "cuda")]

mod common;

use common::host::{assert_close, cast, down, up, zeros, Rng, TestDtype};
use half::bf16;
use novainfer_cuda::ops::gather::{chain_tokens, gather_columns, gather_rows};
use novainfer_cuda::ops::gemm::{gemm_bf16, gemm_bf16_f32out, GemmShape};
use novainfer_cuda::ops::kv::{copy_block, BlockCopy, KvCacheMut, KvGeometry};
use novainfer_cuda::ops::qkv::{qkv_bias_rope_cache, QkvInput};
use novainfer_cuda::ops::rope::{RopeHeads, RopeTable};
use novainfer_cuda::ops::DtypeKind;
use novainfer_cuda::{CudaError, GpuContext};
use novainfer_model::layers::ops as cpu;

fn bf16s(v: &[f32]) -> (Vec<bf16>, Vec<f32>) {
    cast::<bf16>(v)
}

#[test]
fn gemm_matches_cpu_on_the_first_rows_of_a_buffer() {
    let Some(gpu) = common::gpu_or_skip("gemm") else {
        return;
    };
    let (m, n, k, capacity) = (5, 96, 320, 8);
    let mut rng = Rng(11);
    let (x, x32) = bf16s(&rng.vec(capacity * k, 1.0));
    let (w, w32) = bf16s(&rng.vec(n * k, 1.0));
    // y[i][j] = Σ_l x[i][l]·W[j][l], in f64 on the bf16-rounded inputs; and Σ|terms| for the
    // f32 summation-order bound.
    let mut expected = vec![0f32; m * n];
    let mut magnitude = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let terms = (0..k).map(|l| f64::from(x32[i * k + l]) * f64::from(w32[j * k + l]));
            let (sum, abs) = terms.fold((0f64, 0f64), |(s, a), t| (s + t, a + t.abs()));
            expected[i * n + j] = sum as f32;
            magnitude[i * n + j] = abs as f32;
        }
    }
    let (dx, dw) = (up(&gpu, &x), up(&gpu, &w));
    let shape = GemmShape { m, n, k };

    let mut y = zeros::<bf16>(&gpu, capacity * n);
    gemm_bf16(
        &gpu,
        &dx.slice(0..m * k),
        &dw.as_view(),
        shape,
        &mut y.slice_mut(0..m * n),
    )
    .expect("gemm bf16");
    let got = down(&gpu, &y);
    assert_close("gemm bf16", &got[..m * n], &expected);
    assert!(
        got[m * n..].iter().all(|v| v.to_f32() == 0.0),
        "rows past m untouched"
    );

    let mut y32 = zeros::<f32>(&gpu, capacity * n);
    gemm_bf16_f32out(
        &gpu,
        &dx.slice(0..m * k),
        &dw.as_view(),
        shape,
        &mut y32.slice_mut(0..m * n),
    )
    .expect("gemm f32 out");
    let got = down(&gpu, &y32);
    for (i, (g, c)) in got.iter().zip(&expected).enumerate() {
        // Exact products (bf16·bf16 fits f32), f32 sums in cuBLAS's order: at most
        // k·2⁻²⁴·Σ|terms| ≈ 2e-5·Σ|terms| apart for k = 320; 1e-4 leaves a margin.
        assert!(
            (g - c).abs() <= 1e-4 * magnitude[i] + 1e-6,
            "gemm f32 element {i}: gpu {g} vs cpu {c}"
        );
    }

    // m = 0 is a no-op; a wrong length is refused on the host.
    let empty = GemmShape { m: 0, n, k };
    gemm_bf16(
        &gpu,
        &dx.slice(0..0),
        &dw.as_view(),
        empty,
        &mut y.slice_mut(0..0),
    )
    .expect("m = 0");
    let err = gemm_bf16(
        &gpu,
        &dx.slice(0..m * k - 1),
        &dw.as_view(),
        shape,
        &mut y.slice_mut(0..m * n),
    )
    .expect_err("short x");
    assert!(
        matches!(err, CudaError::InvalidArgument { param: "x", .. }),
        "{err}"
    );
}

/// The CPU path the fused kernel replaces: bias add, `Rope::apply` on q and k, then the
/// cache write of `PagedKvCache::write` (slots < 0 skipped).
struct CpuQkv {
    q: Vec<f32>,
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn cpu_qkv(
    qkv: &[f32],
    bias: Option<&[f32]>,
    positions: &[usize],
    slots: &[i64],
    (nh, nkv, hd): (usize, usize, usize),
    theta: f64,
    num_slots: usize,
) -> CpuQkv {
    let (q_len, kv_len) = (nh * hd, nkv * hd);
    let row = q_len + 2 * kv_len;
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for t in 0..positions.len() {
        let mut r = qkv[t * row..(t + 1) * row].to_vec();
        if let Some(b) = bias {
            r.iter_mut().zip(b).for_each(|(x, b)| *x += b);
        }
        q.extend_from_slice(&r[..q_len]);
        k.extend_from_slice(&r[q_len..q_len + kv_len]);
        v.extend_from_slice(&r[q_len + kv_len..]);
    }
    let rope = cpu::Rope::new(hd, theta);
    rope.apply(&mut q, positions, hd);
    rope.apply(&mut k, positions, hd);
    let (mut k_cache, mut v_cache) = (
        vec![0f32; num_slots * kv_len],
        vec![0f32; num_slots * kv_len],
    );
    for (t, &s) in slots.iter().enumerate() {
        if s < 0 {
            continue;
        }
        let s = s as usize;
        k_cache[s * kv_len..(s + 1) * kv_len].copy_from_slice(&k[t * kv_len..(t + 1) * kv_len]);
        v_cache[s * kv_len..(s + 1) * kv_len].copy_from_slice(&v[t * kv_len..(t + 1) * kv_len]);
    }
    CpuQkv {
        q,
        k_cache,
        v_cache,
    }
}

fn qkv_body<T: TestDtype>(gpu: &GpuContext, with_bias: bool) {
    let (nh, nkv, hd, theta) = (14, 2, 64, 1_000_000.0);
    let positions = [0usize, 5, 4095, 31, 7];
    let slots = [3i64, -1, 17, 0, 9]; // token 1 is graph padding
    let (n, capacity, num_slots) = (positions.len(), 8, 24);
    let (q_len, kv_len) = (nh * hd, nkv * hd);
    let row = q_len + 2 * kv_len;
    let mut rng = Rng(12);
    let (qkv, qkv32) = cast::<T>(&rng.vec(capacity * row, 2.0));
    let bias = rng.vec(row, 0.5);
    let want = cpu_qkv(
        &qkv32[..n * row],
        with_bias.then_some(&bias[..]),
        &positions,
        &slots,
        (nh, nkv, hd),
        theta,
        num_slots,
    );

    let table = RopeTable::new(gpu, hd, theta, 4096).expect("table");
    let pos_i32: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let (dqkv, dbias, dpos, dslots) = (
        up(gpu, &qkv),
        up(gpu, &bias),
        up(gpu, &pos_i32),
        up(gpu, &slots),
    );
    let mut q_out = zeros::<T>(gpu, capacity * q_len);
    let (mut kc, mut vc) = (
        zeros::<T>(gpu, num_slots * kv_len),
        zeros::<T>(gpu, num_slots * kv_len),
    );
    let heads = RopeHeads {
        num_heads: nh,
        num_kv_heads: nkv,
    };
    qkv_bias_rope_cache(
        gpu,
        &table,
        heads,
        QkvInput {
            qkv: dqkv.slice(0..n * row),
            bias: with_bias.then(|| dbias.as_view()),
            positions: dpos.as_view(),
            slot_mapping: dslots.as_view(),
        },
        &mut q_out.slice_mut(0..n * q_len),
        KvCacheMut {
            k: kc.as_view_mut(),
            v: vc.as_view_mut(),
        },
    )
    .expect("launch");
    let (gq, gk, gv) = (down(gpu, &q_out), down(gpu, &kc), down(gpu, &vc));
    assert!(
        gq[n * q_len..].iter().all(|v| v.to_f32() == 0.0),
        "rows past T untouched"
    );
    let gq = &gq[..n * q_len];
    if T::KIND == DtypeKind::F32 {
        // Same additions, same table, same unfused rotation: bit for bit.
        let bits = |g: &[T], c: &[f32]| {
            g.iter()
                .zip(c)
                .all(|(g, c)| g.to_f32().to_bits() == c.to_bits())
        };
        assert!(bits(gq, &want.q), "q");
        assert!(bits(&gk, &want.k_cache), "k cache");
        assert!(bits(&gv, &want.v_cache), "v cache");
    } else {
        assert_close("qkv q", gq, &want.q);
        assert_close("qkv k cache", &gk, &want.k_cache);
        assert_close("qkv v cache", &gv, &want.v_cache);
    }
}

#[test]
fn qkv_bias_rope_cache_matches_the_cpu_path() {
    let Some(gpu) = common::gpu_or_skip("qkv_bias_rope_cache") else {
        return;
    };
    for with_bias in [true, false] {
        qkv_body::<f32>(&gpu, with_bias);
        qkv_body::<bf16>(&gpu, with_bias);
    }
}

fn gather_body<T: TestDtype>(gpu: &GpuContext) {
    let (src_rows, d) = (6, 200);
    let mut rng = Rng(13);
    let (x, _) = cast::<T>(&rng.vec(src_rows * d, 4.0));
    let rows = [4i32, 0, 4, 5, 6]; // 6 is past x: a zero row
    let mut out = zeros::<T>(gpu, rows.len() * d);
    gather_rows(
        gpu,
        &up(gpu, &x).as_view(),
        &up(gpu, &rows).as_view(),
        d,
        &mut out.as_view_mut(),
    )
    .expect("launch");
    let got = down(gpu, &out);
    for (i, &r) in rows.iter().enumerate() {
        let got_row = &got[i * d..(i + 1) * d];
        if (r as usize) < src_rows {
            let want = &x[r as usize * d..(r as usize + 1) * d];
            assert!(
                got_row
                    .iter()
                    .zip(want)
                    .all(|(g, w)| g.to_f32().to_bits() == w.to_f32().to_bits()),
                "row {i}"
            );
        } else {
            assert!(got_row.iter().all(|v| v.to_f32() == 0.0), "row {i} is zero");
        }
    }
}

#[test]
fn gather_rows_copies_the_chosen_rows() {
    let Some(gpu) = common::gpu_or_skip("gather_rows") else {
        return;
    };
    gather_body::<f32>(&gpu);
    gather_body::<bf16>(&gpu);
}

/// A fresh random permutation of `0..d` (Fisher-Yates on the test generator).
fn permutation(rng: &mut Rng, d: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..d as u32).collect();
    for i in (1..d).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

fn gather_columns_body<T: TestDtype>(gpu: &GpuContext) {
    // d of the 0.5B's hidden size, rows a few; plus an order entry past the row (zero).
    let (rows, d) = (5, 896);
    let mut rng = Rng(21);
    let (x, _) = cast::<T>(&rng.vec(rows * d, 4.0));
    let mut order = permutation(&mut rng, d);
    order[7] = d as u32;
    let mut out = zeros::<T>(gpu, rows * d);
    gather_columns(
        gpu,
        &up(gpu, &x).as_view(),
        &up(gpu, &order).as_view(),
        &mut out.as_view_mut(),
    )
    .expect("launch");
    let got = down(gpu, &out);
    for r in 0..rows {
        for (j, &c) in order.iter().enumerate() {
            let want = if (c as usize) < d {
                x[r * d + c as usize].to_f32()
            } else {
                0.0
            };
            let g = got[r * d + j].to_f32();
            assert_eq!(g.to_bits(), want.to_bits(), "row {r}, column {j}");
        }
    }
}

#[test]
fn gather_columns_permutes_each_row() {
    let Some(gpu) = common::gpu_or_skip("gather_columns") else {
        return;
    };
    gather_columns_body::<f32>(&gpu);
    gather_columns_body::<bf16>(&gpu);
}

#[test]
fn copy_block_matches_the_cpu_pool() {
    let Some(gpu) = common::gpu_or_skip("copy_block") else {
        return;
    };
    let geometry = KvGeometry {
        block_size: 4,
        kv_row: 8,
    };
    let num_blocks = 5;
    let block_len = geometry.block_size * geometry.kv_row;
    let mut rng = Rng(14);
    let mut k = rng.vec(num_blocks * block_len, 1.0);
    let mut v = rng.vec(num_blocks * block_len, 1.0);
    let (mut dk, mut dv) = (up(&gpu, &k), up(&gpu, &v));
    // Forward and backward in the pool, partial and whole blocks (PagedKvCache::copy_block).
    for copy in [
        BlockCopy {
            src: 2,
            dst: 0,
            num_tokens: 3,
        },
        BlockCopy {
            src: 1,
            dst: 4,
            num_tokens: 4,
        },
        BlockCopy {
            src: 3,
            dst: 3,
            num_tokens: 2,
        },
    ] {
        let cache = KvCacheMut {
            k: dk.as_view_mut(),
            v: dv.as_view_mut(),
        };
        copy_block(&gpu, cache, geometry, copy).expect("copy");
        let (from, to, len) = (
            copy.src * block_len,
            copy.dst * block_len,
            copy.num_tokens * geometry.kv_row,
        );
        k.copy_within(from..from + len, to);
        v.copy_within(from..from + len, to);
    }
    assert_eq!(down(&gpu, &dk), k);
    assert_eq!(down(&gpu, &dv), v);
    let cache = KvCacheMut {
        k: dk.as_view_mut(),
        v: dv.as_view_mut(),
    };
    let err = copy_block(
        &gpu,
        cache,
        geometry,
        BlockCopy {
            src: 5,
            dst: 0,
            num_tokens: 1,
        },
    )
    .expect_err("block 5 is outside the pool");
    assert!(
        matches!(err, CudaError::InvalidArgument { param: "copy", .. }),
        "{err}"
    );
}

#[test]
fn chain_tokens_writes_the_drawn_ids_and_skips_pairs_outside() {
    let Some(gpu) = common::gpu_or_skip("chain_tokens") else {
        return;
    };
    let drawn = up(&gpu, &[100u32, 101, 102]);
    let mut ids = up(&gpu, &[7u32, 7, 7, 7, 7]);
    // Row 4 takes drawn row 2, row 0 drawn row 0; a row past the step and a drawn row past
    // the draws are skipped.
    let pairs = up(&gpu, &[4i32, 2, 0, 0, 5, 1, 1, 3]);
    chain_tokens(
        &gpu,
        &drawn.as_view(),
        &pairs.as_view(),
        &mut ids.as_view_mut(),
    )
    .expect("launch");
    assert_eq!(down(&gpu, &ids), [100, 7, 7, 7, 102]);
    let odd = up(&gpu, &[1i32]);
    assert!(chain_tokens(
        &gpu,
        &drawn.as_view(),
        &odd.as_view(),
        &mut ids.as_view_mut()
    )
    .is_err());
}
