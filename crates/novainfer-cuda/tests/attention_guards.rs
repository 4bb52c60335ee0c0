//! What the attention launchers and kernels do with inputs they must not trust: a batch
//! longer than the decode scratch or the block table (refused on the host), and block
//! tables that name no valid block (masked keys: zeros, never NaN). Each test skips without
//! a GPU (fails under `NOVAINFER_REQUIRE_GPU`).

#![cfg(feature = "cuda")]

mod common;

use common::host::{down, up, zeros, Rng};
use novainfer_cuda::cudarc::driver::CudaSlice;
use novainfer_cuda::ops::paged_attention::{
    paged_attention_decode, paged_attention_prefill, AttentionConfig, DecodeScratch, PagedKv,
    ATTN_SPLIT,
};
use novainfer_cuda::{CudaError, GpuContext};

const CFG: AttentionConfig = AttentionConfig {
    num_heads: 4,
    num_kv_heads: 2,
    head_dim: 64,
    block_size: 16,
    max_blocks_per_seq: 40, // 640 positions
};

struct Pool {
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    tables: CudaSlice<i32>,
    lens: CudaSlice<i32>,
}

impl Pool {
    /// `num_blocks` random blocks; one sequence per table row.
    fn new(gpu: &GpuContext, num_blocks: usize, tables: &[i32], lens: &[i32]) -> Self {
        let values = num_blocks * CFG.block_size * CFG.num_kv_heads * CFG.head_dim;
        let mut rng = Rng(21);
        Self {
            k: up(gpu, &rng.vec(values, 1.0)),
            v: up(gpu, &rng.vec(values, 1.0)),
            tables: up(gpu, tables),
            lens: up(gpu, lens),
        }
    }

    fn kv(&self) -> PagedKv<'_, f32> {
        PagedKv {
            k_cache: self.k.as_view(),
            v_cache: self.v.as_view(),
            block_tables: self.tables.as_view(),
            seq_lens: self.lens.as_view(),
        }
    }
}

fn param(r: novainfer_cuda::Result<()>) -> &'static str {
    match r {
        Err(CudaError::InvalidArgument { param, .. }) => param,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn decode_refuses_a_batch_longer_than_its_scratch_or_table() {
    let Some(gpu) = common::gpu_or_skip("decode refusal") else {
        return;
    };
    let tables: Vec<i32> = (0..CFG.max_blocks_per_seq as i32).collect();
    let pool = Pool::new(&gpu, CFG.max_blocks_per_seq, &tables, &[600]);
    let row = CFG.num_heads * CFG.head_dim;
    let q = up(&gpu, &Rng(22).vec(row, 1.0));
    let mut out = zeros::<f32>(&gpu, row);
    // Scratch for one split: 600 positions would have been cut to 512 before.
    let mut scratch = DecodeScratch::new(&gpu, &CFG, 1, ATTN_SPLIT).expect("scratch");
    assert_eq!(scratch.max_seq_len(), ATTN_SPLIT);
    let mut run = |max_seq_len, scratch: &mut DecodeScratch| {
        paged_attention_decode(
            &gpu,
            &CFG,
            &q.as_view(),
            pool.kv(),
            max_seq_len,
            scratch,
            &mut out.as_view_mut(),
        )
    };
    assert_eq!(param(run(600, &mut scratch)), "max_seq_len");
    // Room in the scratch, but a table row holds 40 blocks of 16 = 640 positions.
    let mut big = DecodeScratch::new(&gpu, &CFG, 1, 2048).expect("scratch");
    assert_eq!(param(run(641, &mut big)), "max_seq_len");
    run(600, &mut big).expect("600 positions fit both");
}

/// Every key of a sequence masked (its table names blocks outside the pool, or its history
/// lies past its table row): the row is zeros in both kernels, never NaN.
#[test]
fn all_masked_rows_are_zero_not_nan() {
    let Some(gpu) = common::gpu_or_skip("all-masked attention") else {
        return;
    };
    let width = CFG.max_blocks_per_seq;
    let num_blocks = 4;
    // seq 0: blocks 0, 1 (valid, 20 positions); seq 1: 40 positions through blocks 99, -3
    // (outside the pool: masked); seq 2: 20 positions, first block valid, second not.
    let mut tables = vec![0i32; 3 * width];
    tables[..2].copy_from_slice(&[0, 1]);
    tables[width..width + 3].copy_from_slice(&[99, -3, 1000]);
    tables[2 * width..2 * width + 2].copy_from_slice(&[2, 77]);
    let lens = [20, 40, 20];
    let pool = Pool::new(&gpu, num_blocks, &tables, &lens);
    let row = CFG.num_heads * CFG.head_dim;
    let q = up(&gpu, &Rng(23).vec(3 * row, 1.0));

    let mut scratch = DecodeScratch::new(&gpu, &CFG, 4, 640).expect("scratch");
    let mut decode = zeros::<f32>(&gpu, 3 * row);
    paged_attention_decode(
        &gpu,
        &CFG,
        &q.as_view(),
        pool.kv(),
        40,
        &mut scratch,
        &mut decode.as_view_mut(),
    )
    .expect("decode");
    let decode = down(&gpu, &decode);
    assert!(
        decode.iter().all(|v| v.is_finite()),
        "decode made a NaN/inf"
    );
    assert!(
        decode[row..2 * row].iter().all(|&v| v == 0.0),
        "all-masked row is zero"
    );
    assert!(
        decode[..row].iter().any(|&v| v != 0.0),
        "a valid row attends"
    );
    assert!(
        decode[2 * row..].iter().any(|&v| v != 0.0),
        "a half-valid row attends"
    );

    // The same rows through the prefill kernel: the same bits.
    let mut prefill = zeros::<f32>(&gpu, 3 * row);
    paged_attention_prefill(
        &gpu,
        &CFG,
        &q.as_view(),
        pool.kv(),
        &up(&gpu, &[0i32, 1, 2, 3]).as_view(),
        &up(&gpu, &[19i32, 39, 19]).as_view(),
        &mut prefill.as_view_mut(),
    )
    .expect("prefill");
    let prefill = down(&gpu, &prefill);
    assert!(
        prefill
            .iter()
            .zip(&decode)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "decode and prefill agree on masked rows"
    );
}
