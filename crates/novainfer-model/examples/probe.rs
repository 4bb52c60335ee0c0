//! Ad-hoc probe: load a model, greedy-decode a few tokens, time prefill and decode.
//! `cargo run --release -p novainfer-model --example probe -- MODEL [--requant]
//!  [--prompt-tokens N] [--decode-tokens M] [--repeat R] [--kv-cache-dtype auto|f32|f16|bf16|q8_0]`
//! (`--requant` re-encodes Q5_0 as Q8_0; the engine's default keeps Q5_0). Prefill is timed over
//! an N-token prompt (default 512), decode over the M steps after it (default 64), so decode
//! runs at depth N; each of the R runs prints its own figures.
use std::time::Instant;

use novainfer_model::{KvCacheDtype, LoadOptions, LogitsFor, Qwen2Model};

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0 as u32
}

fn flag(args: &[String], name: &str, default: usize) -> anyhow::Result<usize> {
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args
            .get(i + 1)
            .ok_or_else(|| anyhow::anyhow!("{name} needs a value"))?
            .parse()?),
        None => Ok(default),
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let kv_cache_dtype = match args.iter().position(|a| a == "--kv-cache-dtype") {
        Some(i) => KvCacheDtype::parse(args.get(i + 1).map_or("", String::as_str))?,
        None => KvCacheDtype::Auto,
    };
    let opts = LoadOptions {
        requantize_q5_0: args.iter().any(|a| a == "--requant"),
        kv_cache_dtype,
        ..Default::default()
    };
    let prompt_tokens = flag(&args, "--prompt-tokens", 512)?;
    let decode_tokens = flag(&args, "--decode-tokens", 64)?;
    let repeat = flag(&args, "--repeat", 1)?;
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
    let long: Vec<u32> = (0..prompt_tokens)
        .map(|i| 100 + (i * 37 % 5000) as u32)
        .collect();
    for _ in 0..repeat {
        let mut cache = model.new_cache(prompt_tokens + decode_tokens);
        let t = Instant::now();
        let mut logits = model.forward(&long, &mut cache, LogitsFor::LastToken)?;
        let pf = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..decode_tokens {
            let tok = argmax(&logits);
            logits = model.forward(&[tok], &mut cache, LogitsFor::LastToken)?;
        }
        let dc = t.elapsed().as_secs_f64();
        println!(
            "prefill {prompt_tokens}: {:.1} tok/s; decode {decode_tokens} at depth {prompt_tokens}: \
             {:.1} tok/s",
            prompt_tokens as f64 / pf,
            decode_tokens as f64 / dc
        );
    }
    Ok(())
}
