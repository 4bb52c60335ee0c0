//! An n > 1 fork copies its parent's partially filled block (`Executor::copy_block`) and then
//! decodes on its own: its logits must be exactly those of the same history computed without
//! a fork. On the CPU they are equal bit for bit, in every KV storage format. (The GPU test
//! `cuda_forward.rs` runs the same schedule on the device; the difference the first GPU run
//! reported there is the bf16 sensitivity of one row, not the copy: see its header.)

mod common;

use novainfer_model::{CpuExecutor, Executor, ForwardBatch, PagedKvCache, Qwen2Config};

const BLOCK_SIZE: usize = 4;

/// The GPU test's model (head_dim 64), untied or tied.
fn config(tie: bool) -> Qwen2Config {
    common::config_hd64(tie)
}

fn slots(table: &[u32], positions: std::ops::Range<usize>) -> Vec<usize> {
    positions
        .map(|p| table[p / BLOCK_SIZE] as usize * BLOCK_SIZE + p % BLOCK_SIZE)
        .collect()
}

fn step(seqs: &[(&[u32], usize, &[u32])]) -> ForwardBatch {
    let mut b = ForwardBatch::default();
    for &(tokens, start, table) in seqs {
        b.push(
            tokens,
            start,
            slots(table, start..start + tokens.len()),
            table.to_vec(),
            true,
        );
    }
    b
}

#[test]
fn a_forked_sequence_equals_its_history_computed_without_a_fork() {
    for tie in [false, true] {
        for kv in ["f32", "f16", "bf16", "q8_0"] {
            let cfg = config(tie);
            let w = common::round_to_bf16(common::weights(&cfg));
            let model = common::build_kv(cfg.clone(), w, kv).expect("model");
            let pool = PagedKvCache::new(&cfg, 32, BLOCK_SIZE, model.kv_dtype());
            let mut cpu = CpuExecutor::new(model, pool);
            let v = cfg.vocab_size;
            let a: [u32; 9] = [3, 17, 42, 8, 8, 0, 31, 5, 9];
            let (ta, fork) = ([3u32, 9, 12], [3u32, 11, 13]);
            // a prefills 6 tokens and decodes one: block 9 holds positions 4..7, 3 filled.
            cpu.forward(&step(&[(&a[..6], 0, &ta[..2])]))
                .expect("prefill");
            cpu.forward(&step(&[(&a[6..7], 6, &ta[..2])]))
                .expect("decode");
            // The fork takes its own copy of the partial block, then both decode twice, the
            // second time each into a fresh block.
            cpu.copy_block(9, 11, 3).expect("fork");
            cpu.forward(&step(&[(&a[7..8], 7, &ta[..2]), (&[60], 7, &fork[..2])]))
                .expect("decode after the fork");
            let both = cpu
                .forward(&step(&[(&a[8..9], 8, &ta), (&[10], 8, &fork)]))
                .expect("decode across blocks")
                .logits;
            let history: Vec<u32> = a[..7].iter().copied().chain([60, 10]).collect();
            let fresh = cpu
                .forward(&step(&[(&history, 0, &[20, 21, 22])]))
                .expect("fresh")
                .logits;
            assert_eq!(fresh[..], both[v..], "tie={tie} kv={kv}: the fork");
            // The parent is untouched by its child's writes.
            let parent = cpu
                .forward(&step(&[(&a[..9], 0, &[24, 25, 26])]))
                .expect("parent fresh")
                .logits;
            assert_eq!(parent[..], both[..v], "tie={tie} kv={kv}: the parent");
        }
    }
}
