//! Ad-hoc probe: load a model, greedy-decode a few tokens, time prefill and decode.
//! `cargo run --release -p novainfer-model --example probe -- MODEL [--requant]`
//! (`--requant` re-encodes Q5_0 as Q8_0; the engine's default keeps Q5_0)
use std::time::Instant;

use novainfer_model::{LoadOptions, LogitsFor, Qwen2Model};

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0 as u32
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let opts = LoadOptions {
        requantize_q5_0: args.iter().any(|a| a == "--requant"),
        ..Default::default()
    };
    let t = Instant::now();
    let loaded = Qwen2Model::load(std::path::Path::new(&args[1]), &opts)?;
    let model = loaded.model;
    println!("load {:.2}s", t.elapsed().as_secs_f64());
    let prompt = [3838u32, 374, 279, 6722, 315, 9625, 30];
    let mut cache = model.new_cache(2048);
    let mut logits = model.forward(&prompt, &mut cache, LogitsFor::LastToken)?;
    let mut out = vec![];
    for _ in 0..10 {
        let t = argmax(&logits);
        out.push(t);
        logits = model.forward(&[t], &mut cache, LogitsFor::LastToken)?;
    }
    println!("greedy {out:?}");
    let long: Vec<u32> = (0..512).map(|i| 100 + (i * 37 % 5000) as u32).collect();
    let mut cache = model.new_cache(2048);
    let t = Instant::now();
    let mut logits = model.forward(&long, &mut cache, LogitsFor::LastToken)?;
    let pf = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..64 {
        let tok = argmax(&logits);
        logits = model.forward(&[tok], &mut cache, LogitsFor::LastToken)?;
    }
    let dc = t.elapsed().as_secs_f64();
    println!(
        "prefill 512: {:.1} tok/s; decode 64: {:.1} tok/s",
        512.0 / pf,
        64.0 / dc
    );
    Ok(())
}
