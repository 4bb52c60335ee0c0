//! Time of a structured-output token mask with the real Qwen2.5 vocabulary (151,665 tokens):
//! compiling a JSON Schema, then per token of a valid output the mask computation (llguidance;
//! the engine runs it on a worker while the forward pass runs) and its application to a logits
//! row (on the engine thread). Also the `tool_choice: auto` grammar over free text, where every
//! token is checked against the `<tool_call>` trigger.
//!
//! `cargo bench --release -p novainfer-engine --bench grammar_mask` (the 0.5B demo GGUF must be
//! fetched: `novainfer fetch qwen2.5-coder-0.5b`; `NOVAINFER_BENCH_GGUF=path` picks another).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file::Content;
use novainfer_core::StructuredOutput;
use novainfer_engine::structured::tool_grammar::{auto_tool_call_grammar, ToolSpec};
use novainfer_engine::structured::{vocab, GrammarCompiler};
use novainfer_engine::tokenizer::Tokenizer;

/// The schema of `novainfer bench structured` (python/novainfer/bench.py, `BENCH_SCHEMA`).
const SCHEMA: &str = r#"{"type": "object", "properties": {"people": {"type": "array", "minItems": 100,
  "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 40}, "role": {"enum": ["dev", "ops", "pm", "design"]}},
  "required": ["name", "age", "email", "role"], "additionalProperties": false}}},
  "required": ["people"], "additionalProperties": false}"#;

const OUTPUT: &str = r#"{"people":[{"name":"Ada Lovelace","age":36,"email":"ada@example.com","role":"dev"},{"name":"Grace Hopper","age":85,"email":"grace@navy.mil","role":"ops"},{"name":"Alan Turing","age":41,"email":"alan@bletchley.uk","role":"pm"},{"name":"Edsger Dijkstra","age":72,"email":"ewd@utexas.edu","role":"design"},{"name":"Barbara Liskov","age":84"#;

const FREE_TEXT: &str = "The weather in Paris is usually mild in spring, with temperatures between ten and twenty degrees; pack a light jacket and an umbrella, since showers come and go quickly in April and May.";

fn gguf_path() -> PathBuf {
    if let Some(p) = std::env::var_os("NOVAINFER_BENCH_GGUF") {
        return p.into();
    }
    let home = std::env::var_os("NOVAINFER_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/novainfer")
        });
    home.join("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn report(what: &str, mut times: Vec<Duration>) {
    times.sort();
    let mean = times.iter().sum::<Duration>() / times.len() as u32;
    println!(
        "{what}: {} tokens, mean {:.1} µs, p50 {:.1} µs, p90 {:.1} µs, max {:.1} µs",
        times.len(),
        mean.as_secs_f64() * 1e6,
        percentile(&times, 0.5).as_secs_f64() * 1e6,
        percentile(&times, 0.9).as_secs_f64() * 1e6,
        times[times.len() - 1].as_secs_f64() * 1e6,
    );
}

/// Walks `text`'s tokens through `spec`'s matcher: the mask time and apply time per token.
fn walk(
    compiler: &GrammarCompiler,
    tokenizer: &Tokenizer,
    spec: &StructuredOutput,
    text: &str,
    label: &str,
) {
    let ids = tokenizer.encode(text, false).expect("encodes");
    let compiled = compiler.compile(spec).expect("compiles");
    let mut logits = vec![0.5f32; tokenizer.vocab_size()];
    let (mut masks, mut applies) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let mut matcher = compiled.matcher();
        for (at, &id) in ids.iter().enumerate() {
            let t0 = Instant::now();
            matcher.compute_mask().expect("mask");
            let t1 = Instant::now();
            matcher.apply_mask(&mut logits).expect("apply");
            let t2 = Instant::now();
            assert!(
                logits[id as usize].is_finite(),
                "the mask forbids token {id} ({:?}) after {:?}",
                tokenizer.decode(&[id], false),
                tokenizer.decode(&ids[..at], false)
            );
            logits.fill(0.5);
            matcher.accept(id).expect("accepts");
            masks.push(t1 - t0);
            applies.push(t2 - t1);
        }
    }
    report(&format!("{label} mask"), masks);
    report(&format!("{label} apply"), applies);
}

fn main() {
    let path = gguf_path();
    let mut file = std::fs::File::open(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run `novainfer fetch qwen2.5-coder-0.5b`)",
            path.display()
        )
    });
    let content = Content::read(&mut file).expect("reads the GGUF header");
    let tokenizer = Tokenizer::from_gguf(&content.metadata).expect("builds the tokenizer");
    println!("{}: vocabulary {}", path.display(), tokenizer.vocab_size());
    let compiler = {
        let inner = tokenizer.inner().clone();
        let eos = tokenizer.eos_token_ids().to_vec();
        GrammarCompiler::new(move || vocab::tok_env(&inner, &eos))
    };
    let schema = StructuredOutput::JsonSchema(SCHEMA.into());
    let t0 = Instant::now();
    compiler.compile(&schema).expect("compiles");
    let first = t0.elapsed();
    let t0 = Instant::now();
    compiler
        .compile(&StructuredOutput::JsonSchema(
            SCHEMA.replace("\"role\"", "\"team\""),
        ))
        .expect("compiles");
    let second = t0.elapsed();
    println!(
        "compile: first {:.1} ms (vocabulary trie included), another schema {:.1} ms",
        first.as_secs_f64() * 1e3,
        second.as_secs_f64() * 1e3
    );
    walk(&compiler, &tokenizer, &schema, OUTPUT, "json schema");
    let tools = [ToolSpec {
        name: "get_weather".into(),
        parameters: Some(
            serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}}),
        ),
    }];
    walk(
        &compiler,
        &tokenizer,
        &auto_tool_call_grammar(&tools, true),
        FREE_TEXT,
        "tool_choice auto, free text",
    );
}
