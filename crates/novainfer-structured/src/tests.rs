//! The mask and matcher on a tiny vocabulary: every byte, a few multi-byte tokens, two end
//! tokens. Tokens are drawn at random among the allowed ones (the worst a model could do),
//! so every output must still match.

use std::sync::Arc;

use serde_json::Value;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::tool_grammar::{tool_call_grammar, ToolSpec};
use crate::{Constraint, GrammarCompiler, Progress, StructuredError, StructuredOutput};

const EOS: u32 = 256 + 8;
const END_OF_TEXT: u32 = EOS + 1;

fn words() -> Vec<Vec<u8>> {
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    for w in [
        "\"name\"",
        "true",
        "false",
        "{\"",
        "\":",
        "  ",
        "\n\n",
        "<tool_call>",
    ] {
        words.push(w.as_bytes().to_vec());
    }
    words.truncate(EOS as usize);
    words.push(b"\xFF<|im_end|>".to_vec());
    words.push(b"\xFF<|endoftext|>".to_vec());
    words
}

fn env() -> TokEnv {
    let words = words();
    let info = TokRxInfo::new(words.len() as u32, EOS);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&[EOS, END_OF_TEXT]);
    Arc::new(ApproximateTokEnv::new(trie))
}

fn compiler() -> GrammarCompiler {
    GrammarCompiler::new(|| Ok(env()))
}

/// A tiny xorshift: the tests need no real randomness, only many different paths.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Samples up to `max` tokens uniformly among the allowed ones (logits padded past the
/// vocabulary as a model's are); the text and whether the grammar or an end token ended it.
fn generate(c: &mut Constraint, seed: u64, max: usize) -> (String, bool) {
    let words = words();
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut out = Vec::new();
    for step in 0..max {
        if step % 2 == 0 {
            c.prefetch();
        }
        let mut logits = vec![0.0f32; words.len() + 7];
        c.apply_mask(&mut logits).expect("a mask");
        let allowed: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize].is_finite())
            .collect();
        assert!(allowed.iter().all(|&t| (t as usize) < words.len()));
        let token = allowed[(rng.next() % allowed.len() as u64) as usize];
        if token == EOS || token == END_OF_TEXT {
            assert!(
                c.is_accepting(),
                "an end token allowed before the grammar accepts"
            );
            return (String::from_utf8(out).expect("utf-8"), true);
        }
        out.extend_from_slice(&words[token as usize]);
        if c.accept(token).expect("allowed token") == Progress::Finished {
            return (String::from_utf8(out).expect("utf-8"), true);
        }
    }
    (String::from_utf8_lossy(&out).into_owned(), false)
}

/// Valid JSON, numbers of any size included (which `Value` would refuse past `f64`).
fn assert_valid_json(text: &str) {
    serde_json::from_str::<serde::de::IgnoredAny>(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
}

fn constraint(compiler: &GrammarCompiler, spec: StructuredOutput) -> Constraint {
    Constraint::new(compiler.compile(&spec).expect("compiles").matcher())
}

#[test]
fn json_schema_outputs_always_validate() {
    let compiler = compiler();
    let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":5},
        "ok":{"type":"boolean"},"n":{"type":"integer","minimum":-50,"maximum":50}},"required":["name","ok"],
        "additionalProperties":false}"#;
    let mut finished = 0;
    for seed in 0..40 {
        let mut c = constraint(&compiler, StructuredOutput::JsonSchema(schema.into()));
        let (text, done) = generate(&mut c, seed, 200);
        if !done {
            continue;
        }
        finished += 1;
        assert!(
            !text.contains(' ') || text.contains('"'),
            "free whitespace in {text:?}"
        );
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let obj = v.as_object().expect("an object");
        assert!(obj["name"].as_str().expect("string").chars().count() <= 5);
        assert!(obj["ok"].is_boolean());
        assert!(obj
            .keys()
            .all(|k| ["name", "ok", "n"].contains(&k.as_str())));
        assert!(
            obj.get("n").is_none_or(|n| n
                .as_f64()
                .is_some_and(|n| n.fract() == 0.0 && n.abs() <= 50.0)),
            "{text}"
        );
    }
    assert!(finished >= 20, "only {finished} of 40 outputs finished");
}

#[test]
fn json_has_no_free_whitespace_by_default() {
    let compiler = compiler();
    for seed in 0..20 {
        let mut c = constraint(
            &compiler,
            StructuredOutput::JsonSchema(r#"{"type":"array","items":{"type":"boolean"}}"#.into()),
        );
        let (text, _) = generate(&mut c, seed, 60);
        assert!(!text.contains([' ', '\n', '\t']), "{text:?}");
    }
}

#[test]
fn json_object_gives_an_object() {
    let compiler = compiler();
    let mut done = 0;
    for seed in 0..20 {
        let mut c = constraint(&compiler, StructuredOutput::JsonObject);
        let (text, finished) = generate(&mut c, seed, 150);
        if finished {
            done += 1;
            assert_valid_json(&text);
            assert!(text.starts_with('{'), "{text}");
        }
    }
    assert!(done > 0);
}

#[test]
fn regex_and_choice_outputs_match() {
    let compiler = compiler();
    for seed in 0..30 {
        let mut c = constraint(
            &compiler,
            StructuredOutput::Regex("[0-9]{3}-(yes|no)".into()),
        );
        let (text, done) = generate(&mut c, seed, 20);
        assert!(done, "{text:?}");
        let (digits, word) = text.split_once('-').expect("a dash");
        assert!(
            digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()),
            "{text}"
        );
        assert!(word == "yes" || word == "no", "{text}");

        let choices = vec!["red".to_string(), "green \"x\"".into(), "re".into()];
        let mut c = constraint(&compiler, StructuredOutput::Choice(choices.clone()));
        let (text, done) = generate(&mut c, seed, 20);
        assert!(done && choices.contains(&text), "{text:?}");
    }
}

#[test]
fn end_tokens_are_allowed_only_where_the_grammar_accepts() {
    let compiler = compiler();
    let mut c = constraint(&compiler, StructuredOutput::Regex("a+".into()));
    let mut logits = vec![0.0f32; words().len()];
    c.apply_mask(&mut logits).expect("mask");
    assert!(logits[EOS as usize].is_infinite() && logits[END_OF_TEXT as usize].is_infinite());
    assert!(logits[b'a' as usize].is_finite() && logits[b'b' as usize].is_infinite());
    assert_eq!(c.accept(b'a' as u32).expect("allowed"), Progress::Continue);
    let mut logits = vec![0.0f32; words().len()];
    c.apply_mask(&mut logits).expect("mask");
    assert!(logits[EOS as usize].is_finite() && logits[END_OF_TEXT as usize].is_finite());
    assert!(logits[b'a' as usize].is_finite());
}

#[test]
fn a_draft_is_cut_at_the_first_token_the_grammar_refuses() {
    let compiler = compiler();
    let mut c = constraint(&compiler, StructuredOutput::Regex("ab+c".into()));
    let [a, b, c_, z] = [b'a', b'b', b'c', b'z'].map(u32::from);
    assert_eq!(c.valid_prefix(&[a, b, b, c_, EOS]), 5);
    assert_eq!(c.valid_prefix(&[a, b, z, c_]), 2);
    assert_eq!(c.valid_prefix(&[z]), 0);
    // Checking moved nothing: the grammar still starts at `a`.
    c.prefetch();
    assert_eq!(c.valid_prefix(&[a, c_]), 1);
    assert_eq!(c.accept(a).expect("allowed"), Progress::Continue);
}

#[test]
fn a_complete_grammar_finishes_without_an_end_token() {
    let compiler = compiler();
    let mut c = constraint(&compiler, StructuredOutput::Choice(vec!["ab".into()]));
    assert_eq!(c.accept(b'a' as u32).expect("a"), Progress::Continue);
    assert_eq!(c.accept(b'b' as u32).expect("b"), Progress::Finished);
}

#[test]
fn a_forbidden_token_is_an_error_not_a_panic() {
    let compiler = compiler();
    let mut c = constraint(&compiler, StructuredOutput::Regex("a+".into()));
    assert!(matches!(
        c.accept(b'z' as u32),
        Err(StructuredError::Matcher(_))
    ));
}

#[test]
fn bad_constraints_are_invalid_with_a_reason() {
    let compiler = compiler();
    let cases = [
        StructuredOutput::JsonSchema("{not json".into()),
        StructuredOutput::JsonSchema(r#"{"type":"no-such-type"}"#.into()),
        StructuredOutput::JsonSchema("[1,2]".into()),
        StructuredOutput::Regex("(unclosed".into()),
        StructuredOutput::Grammar("start: undefined_rule".into()),
    ];
    for spec in cases {
        match compiler.compile(&spec) {
            Err(StructuredError::Invalid(reason)) => assert!(!reason.is_empty()),
            other => panic!("{spec:?}: {other:?}"),
        }
    }
    assert_eq!(compiler.cached(), 0, "failures are not cached");
}

#[test]
fn each_distinct_constraint_compiles_once() {
    let compiler = compiler();
    let spec = StructuredOutput::Regex("x+".into());
    let a = compiler.compile(&spec).expect("compiles");
    let b = compiler.compile(&spec).expect("compiles");
    assert!(Arc::ptr_eq(&a, &b));
    compiler
        .compile(&StructuredOutput::Regex("y+".into()))
        .expect("compiles");
    assert_eq!(compiler.cached(), 2);
    for i in 0..crate::compiler::CACHE_CAPACITY + 5 {
        compiler
            .compile(&StructuredOutput::Regex(format!("z{{{}}}", i + 1)))
            .expect("compiles");
    }
    assert_eq!(compiler.cached(), crate::compiler::CACHE_CAPACITY);
}

#[test]
fn tool_call_grammar_gives_calls_valid_against_their_schemas() {
    let compiler = compiler();
    let tools = vec![
        ToolSpec {
            name: "get_weather".into(),
            parameters: Some(serde_json::json!({"type":"object",
                "properties":{"city":{"type":"string","maxLength":4}},"required":["city"],
                "additionalProperties":false})),
        },
        ToolSpec {
            name: "ping".into(),
            parameters: None,
        },
    ];
    let mut seen = 0;
    for seed in 0..30 {
        let mut c = constraint(&compiler, tool_call_grammar(&tools, false));
        let (text, done) = generate(&mut c, seed, 200);
        if !done {
            continue;
        }
        seen += 1;
        let body = text
            .strip_prefix("<tool_call>\n")
            .and_then(|t| t.strip_suffix("\n</tool_call>"))
            .unwrap_or_else(|| panic!("{text:?}"));
        assert_valid_json(body);
        if body.starts_with(r#"{"name": "get_weather""#) {
            let call: Value = serde_json::from_str(body).expect("bounded values");
            assert!(call["arguments"]["city"].is_string(), "{body}");
        } else {
            assert!(
                body.starts_with(r#"{"name": "ping", "arguments": {"#),
                "{body}"
            );
        }
        assert!(
            body.starts_with("{\"name\": \""),
            "json.dumps spacing: {body}"
        );
    }
    assert!(seen >= 10, "{seen}");
}

#[test]
fn auto_tool_grammar_is_free_text_until_the_trigger_then_a_valid_call() {
    use crate::tool_grammar::auto_tool_call_grammar;
    let compiler = compiler();
    let tools = vec![ToolSpec {
        name: "f".into(),
        parameters: Some(serde_json::json!({"type":"object",
            "properties":{"a":{"type":"boolean"}},"required":["a"],"additionalProperties":false})),
    }];
    let spec = auto_tool_call_grammar(&tools, true);
    // Free text first; once the trigger is written, only the call's JSON may follow.
    let mut c = constraint(&compiler, spec.clone());
    for b in b"hi <tool_call>\n" {
        let mut logits = vec![0.0f32; words().len()];
        c.apply_mask(&mut logits).expect("mask");
        assert!(logits[*b as usize].is_finite(), "byte {:?}", *b as char);
        c.accept(*b as u32).expect("allowed");
    }
    let mut logits = vec![0.0f32; words().len()];
    c.apply_mask(&mut logits).expect("mask");
    let allowed: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    assert!(
        allowed
            .iter()
            .all(|&t| words()[t as usize].starts_with(b"{")),
        "{allowed:?}"
    );
    // Random free text never contains the trigger; random calls after it are valid.
    let trigger = words()
        .iter()
        .position(|w| w == b"<tool_call>")
        .expect("a trigger token") as u32;
    let mut calls = 0;
    for seed in 0..30 {
        let mut c = constraint(&compiler, spec.clone());
        let (text, _) = generate(&mut c, seed, 40);
        if let Some((_, after)) = text.split_once("<tool_call>") {
            // Written by chance: it starts a call at once.
            let call = "\n{\"name\": \"f\", \"arguments\": {\"a\": ";
            assert!(
                call.starts_with(after) || after.starts_with(call),
                "{text:?}"
            );
        }

        let mut c = constraint(&compiler, spec.clone());
        c.accept(b'o' as u32).expect("free text");
        c.accept(trigger).expect("the trigger");
        let (rest, done) = generate(&mut c, seed, 150);
        if !done {
            continue;
        }
        calls += 1;
        for block in format!("<tool_call>{rest}").split("\n<tool_call>") {
            let body = block
                .trim_start_matches("<tool_call>")
                .strip_prefix('\n')
                .and_then(|b| b.strip_suffix("\n</tool_call>"))
                .unwrap_or_else(|| panic!("{rest:?}"));
            let call: Value =
                serde_json::from_str(body).unwrap_or_else(|e| panic!("{body:?}: {e}"));
            assert_eq!(call["name"], "f");
            assert!(call["arguments"]["a"].is_boolean(), "{body}");
        }
    }
    assert!(calls >= 10, "{calls}");
}

#[test]
fn auto_tool_grammar_takes_an_opening_brace_as_bare_calls() {
    use crate::tool_grammar::auto_tool_call_grammar;
    let compiler = compiler();
    let tools = vec![ToolSpec {
        name: "f".into(),
        parameters: Some(serde_json::json!({"type":"object",
            "properties":{"a":{"type":"boolean"}},"required":["a"],"additionalProperties":false})),
    }];
    let check_bare = |text: &str| {
        for line in text.trim_start().split('\n') {
            let call: Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert_eq!(call["name"], "f", "{text:?}");
            assert!(call["arguments"]["a"].is_boolean(), "{text:?}");
        }
    };
    let mut calls = 0;
    for (seed, lead) in (0..30).zip([&b""[..], b"\n", b" \n"].into_iter().cycle()) {
        for parallel in [true, false] {
            let mut c = constraint(&compiler, auto_tool_call_grammar(&tools, parallel));
            for &b in lead.iter().chain(b"{") {
                c.accept(b as u32).expect("whitespace, then a brace");
            }
            let (rest, done) = generate(&mut c, seed, 150);
            if !done {
                continue;
            }
            calls += 1;
            let text = format!("{}{{{rest}", String::from_utf8_lossy(lead));
            check_bare(&text);
            assert!(
                parallel || !text.trim().contains('\n'),
                "one call: {text:?}"
            );
        }
        // From scratch: free text never opens a JSON object unless it is a valid call.
        let mut c = constraint(&compiler, auto_tool_call_grammar(&tools, true));
        let (text, done) = generate(&mut c, seed, 150);
        if done && text.trim_start().starts_with('{') {
            check_bare(&text);
        }
    }
    assert!(calls >= 20, "{calls}");
}
