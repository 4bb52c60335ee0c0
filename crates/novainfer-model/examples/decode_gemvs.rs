//! How fast the decode GEMVs stream their weights, against the read-bandwidth probe of the same
//! moment (a cloud VM's bandwidth moves by tens of percent within a minute, so a rate means
//! something only beside a probe taken around it). Random weights, no model file:
//!
//! * `step 0.5b|1.5b`: one decode step's matrices in the demo GGUFs' shapes and formats, every
//!   layer's distinct (as in a real step, everything streams from memory), called as the model
//!   calls them (q/k/v together, o, gate/up together, down, then the lm_head); prints each kind's
//!   rate and the step's against the probes before and after it;
//! * `stream FORMAT N K COUNT`: `COUNT` distinct `[N, K]` matrices (`q4k`, `q6k`, `q5_0`, `q8_0`)
//!   one call each, best of 3, and the first one alone again and again (cache-resident: what the
//!   arithmetic allows).
//! * `hot FORMAT N K SECONDS`: one `[N, K]` matrix's product again and again for that long
//!   (median of 100-call batches): the arithmetic's rate alone, steady enough to profile
//!   (`perf record`) or to A/B a kernel change on a noisy machine.
//!
//! `RAYON_NUM_THREADS=2 cargo run --release -p novainfer-model --example decode_gemvs -- step 0.5b`
use std::cell::RefCell;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use novainfer_model::layers::qmatmul::{matmul_many_into, PackedMatrix};
use novainfer_model::memory_bandwidth::read_bandwidth;

fn matrix(format: GgmlDType, n: usize, k: usize) -> anyhow::Result<PackedMatrix> {
    // Any values do: the kernels' speed does not depend on them.
    let w: Vec<f32> = (0..n * k)
        .map(|i| (i.wrapping_mul(2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let w = Tensor::from_vec(w, (n, k), &Device::Cpu)?;
    PackedMatrix::from_qtensor(&QTensor::quantize(&w, format)?)?
        .ok_or_else(|| anyhow::anyhow!("no packed kernel for {format:?} on this CPU"))
}

fn probe() -> f64 {
    read_bandwidth(512 << 20, 3).best_bytes_per_s
}

fn gb_s(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

struct Layer {
    qkv: [PackedMatrix; 3],
    o: PackedMatrix,
    gate_up: [PackedMatrix; 2],
    down: PackedMatrix,
}

/// The matrices of one decode step of the demo GGUFs (Q4_K_M mixes; the 1.5B keeps half its
/// `attn_v`/`ffn_down` in Q6_K, here all of them).
fn step(model: &str) -> anyhow::Result<()> {
    use GgmlDType::{Q4K, Q5_0, Q6K, Q8_0};
    let (layers, h, kv, ffn, q, k, v, down, head) = match model {
        "0.5b" => (24, 896, 128, 4864, Q5_0, Q5_0, Q8_0, Q6K, Q8_0),
        "1.5b" => (28, 1536, 256, 8960, Q4K, Q4K, Q6K, Q6K, Q6K),
        other => anyhow::bail!("step takes 0.5b or 1.5b, not {other}"),
    };
    let layers = (0..layers)
        .map(|_| {
            Ok(Layer {
                qkv: [matrix(q, h, h)?, matrix(k, kv, h)?, matrix(v, kv, h)?],
                o: matrix(q, h, h)?,
                gate_up: [matrix(q, ffn, h)?, matrix(q, ffn, h)?],
                down: matrix(down, h, ffn)?,
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let lm_head = matrix(head, 151_936, h)?;
    let bytes = |ms: &[&PackedMatrix]| ms.iter().map(|m| m.storage_bytes()).sum::<usize>();
    let l0 = &layers[0];
    let kinds = ["q/k/v", "o", "gate/up", "down", "lm_head"];
    let per_step = [
        bytes(&[&l0.qkv[0], &l0.qkv[1], &l0.qkv[2]]) * layers.len(),
        bytes(&[&l0.o]) * layers.len(),
        bytes(&[&l0.gate_up[0], &l0.gate_up[1]]) * layers.len(),
        bytes(&[&l0.down]) * layers.len(),
        bytes(&[&lm_head]),
    ];
    let total: usize = per_step.iter().sum();
    let x = vec![0.5f32; h];
    let x_ffn = vec![0.25f32; ffn];
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    let spent = RefCell::new([0f64; 5]);
    let mut run = || {
        let mut t = Instant::now();
        let mut lap = |kind: usize| {
            let now = Instant::now();
            spent.borrow_mut()[kind] += (now - t).as_secs_f64();
            t = now;
        };
        for l in &layers {
            let [q, k, v] = &l.qkv;
            matmul_many_into(&[q, k, v], &x, 1, &mut [&mut a, &mut b, &mut c]);
            lap(0);
            l.o.matmul_into(&x, 1, &mut a);
            lap(1);
            let [g, u] = &l.gate_up;
            matmul_many_into(&[g, u], &x, 1, &mut [&mut a, &mut b]);
            lap(2);
            l.down.matmul_into(&x_ffn, 1, &mut a);
            lap(3);
        }
        lm_head.matmul_into(&x, 1, &mut a);
        lap(4);
    };
    run();
    println!("{model}: {:.0} MB a step", total as f64 / 1e6);
    const STEPS: usize = 16;
    for round in 0..6 {
        let before = probe();
        *spent.borrow_mut() = [0.0; 5];
        let mut times: Vec<f64> = (0..STEPS)
            .map(|_| {
                let t = Instant::now();
                run();
                t.elapsed().as_secs_f64()
            })
            .collect();
        let after = probe();
        times.sort_by(f64::total_cmp);
        let (median, best) = (times[STEPS / 2], times[0]);
        let high = before.max(after);
        let kinds: Vec<String> = (0..5)
            .map(|i| {
                let rate = gb_s(per_step[i] * STEPS, spent.borrow()[i]);
                format!("{} {rate:.1}", kinds[i])
            })
            .collect();
        println!(
            "round {round}: probe {:.1}-{:.1} GB/s; step median {:.2} ms = {:.1} GB/s ({:.0}% of the higher probe), \
             best {:.2} ms ({:.0}%); GB/s by kind: {}",
            before.min(after) / 1e9,
            high / 1e9,
            median * 1e3,
            gb_s(total, median),
            100.0 * total as f64 / median / high,
            best * 1e3,
            100.0 * total as f64 / best / high,
            kinds.join(", ")
        );
    }
    Ok(())
}

fn format(name: &str) -> anyhow::Result<GgmlDType> {
    Ok(match name {
        "q4k" => GgmlDType::Q4K,
        "q6k" => GgmlDType::Q6K,
        "q5_0" => GgmlDType::Q5_0,
        "q8_0" => GgmlDType::Q8_0,
        other => anyhow::bail!("unknown format {other}"),
    })
}

fn hot(args: &[String]) -> anyhow::Result<()> {
    let [name, n, k, seconds] = args else {
        anyhow::bail!("hot takes FORMAT N K SECONDS");
    };
    let (n, k, seconds): (usize, usize, f64) = (n.parse()?, k.parse()?, seconds.parse()?);
    let mat = matrix(format(name)?, n, k)?;
    let x = vec![0.5f32; k];
    let mut out = Vec::new();
    const BATCH: usize = 100;
    let start = Instant::now();
    let mut rates = Vec::new();
    while start.elapsed().as_secs_f64() < seconds || rates.is_empty() {
        let t = Instant::now();
        for _ in 0..BATCH {
            mat.matmul_into(&x, 1, &mut out);
        }
        rates.push(gb_s(mat.storage_bytes() * BATCH, t.elapsed().as_secs_f64()));
    }
    rates.sort_by(f64::total_cmp);
    let per_call = mat.storage_bytes() as f64 / (rates[rates.len() / 2] * 1e9);
    println!(
        "{name} [{n}, {k}] ({:.2} MB): {:.1} GB/s median of {} batches ({:.2} us a call), best {:.1}",
        mat.storage_bytes() as f64 / 1e6,
        rates[rates.len() / 2],
        rates.len(),
        per_call * 1e6,
        rates[rates.len() - 1]
    );
    Ok(())
}

fn stream(args: &[String]) -> anyhow::Result<()> {
    let [format, n, k, count] = args else {
        anyhow::bail!("stream takes FORMAT N K COUNT");
    };
    let format = self::format(format)?;
    let (n, k, count): (usize, usize, usize) = (n.parse()?, k.parse()?, count.parse()?);
    let mats = (0..count)
        .map(|_| matrix(format, n, k))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let bytes = mats[0].storage_bytes() * count;
    let x = vec![0.5f32; k];
    let mut out = Vec::new();
    let best_of_3 = |f: &mut dyn FnMut()| {
        (0..3)
            .map(|_| {
                let t = Instant::now();
                f();
                gb_s(bytes, t.elapsed().as_secs_f64())
            })
            .fold(0f64, f64::max)
    };
    println!(
        "{format:?} [{n}, {k}] x {count}: {:.2} MB each",
        mats[0].storage_bytes() as f64 / 1e6
    );
    for round in 0..4 {
        let bw = probe();
        let streamed = best_of_3(&mut || mats.iter().for_each(|m| m.matmul_into(&x, 1, &mut out)));
        let hot = best_of_3(&mut || (0..count).for_each(|_| mats[0].matmul_into(&x, 1, &mut out)));
        println!(
            "round {round}: probe {:.1} GB/s, streamed {streamed:.1} GB/s ({:.0}%), cache-resident {hot:.1} GB/s",
            bw / 1e9,
            100.0 * streamed * 1e9 / bw
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("step") => step(args.get(1).map_or("0.5b", String::as_str)),
        Some("stream") => stream(&args[1..]),
        Some("hot") => hot(&args[1..]),
        _ => anyhow::bail!(
            "usage: decode_gemvs step 0.5b|1.5b | stream FORMAT N K COUNT | hot FORMAT N K SECONDS"
        ),
    }
}
