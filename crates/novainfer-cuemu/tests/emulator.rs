//! The emulator's own semantics (cuemu/selftest.cu): shuffles and ballots as CUDA defines
//! them, barriers that skip returned threads, deadlocks and shuffles over returned lanes
//! reported as launch errors, and ldmatrix + mma.sync, used as CUTLASS and flash-attention
//! use them, multiplying matrices. The kernel tests trust these.

mod common;

use common::{addr, Rng};
use half::bf16;
use novainfer_cuemu::{launch, launch_with, Dim3, Schedule};

extern "C-unwind" {
    fn st_shuffles(out: *mut i32);
    fn st_block_sum(x: *const f32, sums: *mut f32, ands: *mut i32);
    fn st_early_return(out: *mut i32);
    fn st_deadlock(out: *mut i32);
    fn st_shuffle_after_return(out: *mut i32);
    fn st_mma(a: *const u16, bt: *const u16, d: *mut f32);
    fn st_ldmatrix_trans(x: *const u16, out: *mut u32);
    fn st_race(out: *mut i32);
}

#[test]
fn shuffles_and_ballots_follow_cuda() {
    let mut out = vec![0i32; 64 * 4];
    let p = addr(out.as_mut_ptr());
    launch(Dim3::x(1), Dim3::x(64), || unsafe { st_shuffles(p as _) }).expect("launch");
    let ballot = (0..32).filter(|l| l % 3 == 0).fold(0u32, |m, l| m | 1 << l) as i32;
    for t in 0..64 {
        let lane = (t % 32) as i32;
        let row = &out[t * 4..t * 4 + 4];
        assert_eq!(row[0], (lane ^ 5) * 10, "xor, thread {t}");
        // A lane with no source keeps its own value.
        assert_eq!(
            row[1],
            if lane >= 3 { lane - 3 } else { lane } * 10,
            "up, thread {t}"
        );
        assert_eq!(
            row[2],
            if lane + 3 < 32 { lane + 3 } else { lane } * 10,
            "down, thread {t}"
        );
        assert_eq!(row[3], ballot, "ballot, thread {t}");
    }
}

#[test]
fn block_reductions_reach_every_thread() {
    let (blocks, threads) = (3usize, 256usize);
    let mut rng = Rng(5);
    let mut x: Vec<f32> = rng
        .f32s(blocks * threads, 1.0)
        .iter()
        .map(|v| v.abs())
        .collect();
    x[threads + 17] = -0.75; // block 1's AND is false
    let (mut sums, mut ands) = (vec![0f32; x.len()], vec![0i32; x.len()]);
    let p = (
        addr(x.as_ptr()),
        addr(sums.as_mut_ptr()),
        addr(ands.as_mut_ptr()),
    );
    launch(Dim3::x(blocks as u32), Dim3::x(threads as u32), || unsafe {
        st_block_sum(p.0 as _, p.1 as _, p.2 as _)
    })
    .expect("launch");
    for b in 0..blocks {
        let want: f64 = x[b * threads..(b + 1) * threads]
            .iter()
            .map(|&v| v as f64)
            .sum();
        let got = &sums[b * threads..(b + 1) * threads];
        assert!(
            got.iter().all(|&s| s.to_bits() == got[0].to_bits()),
            "block {b}: one value"
        );
        assert!(
            (got[0] as f64 - want).abs() < 1e-4,
            "block {b}: {} vs {want}",
            got[0]
        );
        let and = ands[b * threads..(b + 1) * threads]
            .iter()
            .all(|&a| a == i32::from(b != 1));
        assert!(and, "block {b}: __syncthreads_and");
    }
}

#[test]
fn threads_that_returned_leave_the_barrier() {
    let mut out = vec![-1i32; 96];
    let p = addr(out.as_mut_ptr());
    launch(Dim3::x(2), Dim3::x(96), || unsafe {
        st_early_return(p as _)
    })
    .expect("launch");
    for (t, &v) in out.iter().enumerate() {
        assert_eq!(v, if t % 2 == 0 { 48 } else { -1 }, "thread {t}");
    }
}

#[test]
fn a_deadlock_fails_the_launch_with_where_it_waits() {
    let mut out = vec![0i32; 64];
    let p = addr(out.as_mut_ptr());
    let err = launch(Dim3::x(1), Dim3::x(64), || unsafe { st_deadlock(p as _) })
        .expect_err("warps waiting at different barriers never finish");
    assert!(err.0.contains("deadlock"), "{err}");
    // The emulator is usable after a failed launch.
    shuffles_and_ballots_follow_cuda();
}

#[test]
fn a_shuffle_naming_a_returned_lane_is_an_error() {
    let mut out = vec![0i32; 32];
    let p = addr(out.as_mut_ptr());
    let err = launch(Dim3::x(1), Dim3::x(32), || unsafe {
        st_shuffle_after_return(p as _)
    })
    .expect_err("lanes 16-31 returned");
    assert!(
        err.0.contains("returned") || err.0.contains("deadlock"),
        "{err}"
    );
}

#[test]
fn ldmatrix_and_mma_multiply_matrices_as_the_kernels_load_them() {
    let mut rng = Rng(11);
    for _ in 0..3 {
        let a = rng.bf16s(256, 2.0);
        let bt = rng.bf16s(256, 2.0); // bt[n * 16 + k] = B[k][n]
        let mut d = vec![0f32; 256];
        let p = (addr(a.as_ptr()), addr(bt.as_ptr()), addr(d.as_mut_ptr()));
        launch(Dim3::x(1), Dim3::x(32), || unsafe {
            st_mma(p.0 as _, p.1 as _, p.2 as _)
        })
        .expect("launch");
        for i in 0..16 {
            for j in 0..16 {
                let want: f64 = (0..16)
                    .map(|k| a[i * 16 + k].to_f64() * bt[j * 16 + k].to_f64())
                    .sum();
                let got = d[i * 16 + j] as f64;
                assert!((got - want).abs() < 1e-4, "D[{i}][{j}]: {got} vs {want}");
            }
        }
    }
}

#[test]
fn ldmatrix_trans_hands_out_columns() {
    let x: Vec<bf16> = (0..256).map(|i| bf16::from_f32(i as f32)).collect();
    let mut out = vec![0u32; 128];
    let p = (addr(x.as_ptr()), addr(out.as_mut_ptr()));
    launch(Dim3::x(1), Dim3::x(32), || unsafe {
        st_ldmatrix_trans(p.0 as _, p.1 as _)
    })
    .expect("launch");
    let at = |m: usize, row: usize, col: usize| x[m * 64 + row * 8 + col].to_bits() as u32;
    for lane in 0..32 {
        for m in 0..4 {
            let (col, row) = (lane / 4, 2 * (lane % 4));
            let want = at(m, row, col) | at(m, row + 1, col) << 16;
            assert_eq!(out[lane * 4 + m], want, "lane {lane}, matrix {m}");
        }
    }
}

#[test]
fn schedules_expose_a_missing_barrier() {
    let run = |schedule| {
        let mut out = vec![0i32; 64];
        let p = addr(out.as_mut_ptr());
        launch_with(schedule, Dim3::x(1), Dim3::x(64), || unsafe {
            st_race(p as _)
        })
        .expect("launch");
        out
    };
    let forward = run(Schedule::Forward);
    let reverse = run(Schedule::Reverse);
    // Forward, threads read their neighbour's slot before it runs (all but the one the
    // barrier's releaser wrote); in reverse, after (all but the releaser's own read).
    let fresh = |out: &[i32]| (0..64).filter(|&t| out[t] == ((t + 1) % 64) as i32).count();
    assert_eq!(fresh(&forward), 1, "{forward:?}");
    assert_eq!(fresh(&reverse), 63, "{reverse:?}");
    let shuffled = run(Schedule::Shuffle(3));
    assert_ne!(shuffled, forward);
    assert_ne!(shuffled, reverse);
    assert_eq!(
        run(Schedule::Shuffle(3)),
        shuffled,
        "a seed replays its order"
    );
}

#[test]
fn the_schedule_setting_parses() {
    assert_eq!(Schedule::parse("").ok(), Some(Schedule::Forward));
    assert_eq!(Schedule::parse("reverse").ok(), Some(Schedule::Reverse));
    assert_eq!(Schedule::parse("shuffle").ok(), Some(Schedule::Shuffle(1)));
    assert_eq!(
        Schedule::parse("shuffle:42").ok(),
        Some(Schedule::Shuffle(42))
    );
    assert!(Schedule::parse("random").is_err());
    assert!(Schedule::parse("shuffle:x").is_err());
}
