//! Builds a `tokenizers::Tokenizer` from the tokenizer llama.cpp stores in GGUF metadata, shaped
//! like the Qwen2 `tokenizer.json` transformers ships: NFC normalizer, Split(Qwen2 regex) +
//! ByteLevel pre-tokenizer, byte-level BPE, ByteLevel decoder and post-processor.
//!
//! Metadata read: `tokenizer.ggml.{model, pre, tokens, token_type, merges, bos_token_id,
//! eos_token_id, padding_token_id, add_bos_token}` and `tokenizer.chat_template`.
//! Invariants: token id i is `tokens[i]` (every token, added ones included, sits in the BPE vocab
//! so GGUF ids are kept as they are); token type 3 (control) becomes a special added token and
//! type 4 (user-defined) a non-special added token, so text like `<|im_start|>` encodes to its id.
//!
//! Eos choice: only `tokenizer.ggml.eos_token_id` is reported as eos. The ids of all control
//! tokens are returned as well, so the engine can decide to stop on others (e.g. `<|im_end|>` vs
//! `<|endoftext|>`) without this module guessing from token names.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::tokenizer_error::TokenizerError;

/// The pre-tokenizer regex of Qwen2's `tokenizer.json` (llama.cpp pre-tokenizer "qwen2").
pub const QWEN2_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp pre-tokenizer names that use the Qwen2 regex.
const QWEN2_PRE_NAMES: &[&str] = &["qwen2", "deepseek-r1-qwen"];

/// llama.cpp token types (`llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// A tokenizer rebuilt from GGUF metadata, with the special-token facts that came with it.
#[derive(Debug, Clone)]
pub struct GgufTokenizer {
    pub tokenizer: tokenizers::Tokenizer,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    pub add_bos_token: bool,
    pub chat_template: Option<String>,
    /// Ids of token type 3 ("control"), ascending.
    pub control_token_ids: Vec<u32>,
}

// Long: reads the GGUF tokenizer keys in the order the format lists them, then assembles the
// tokenizer from them; each key's check is a few lines.
pub fn build(metadata: &HashMap<String, Value>) -> Result<GgufTokenizer, TokenizerError> {
    let model = required_str(metadata, "tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(unsupported("tokenizer.ggml.model", model, "gpt2"));
    }
    let pre = required_str(metadata, "tokenizer.ggml.pre")?;
    if !QWEN2_PRE_NAMES.contains(&pre) {
        return Err(unsupported(
            "tokenizer.ggml.pre",
            pre,
            &QWEN2_PRE_NAMES.join(", "),
        ));
    }

    let tokens = string_array(metadata, "tokenizer.ggml.tokens")?;
    let token_types = match metadata.get("tokenizer.ggml.token_type") {
        Some(value) => int_array(value, "tokenizer.ggml.token_type")?,
        None => Vec::new(),
    };
    if !token_types.is_empty() && token_types.len() != tokens.len() {
        return Err(gguf_error(
            "tokenizer.ggml.token_type",
            format!(
                "has {} entries but there are {} tokens",
                token_types.len(),
                tokens.len()
            ),
        ));
    }
    let merges = parse_merges(&string_array(metadata, "tokenizer.ggml.merges")?)?;

    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, token)| Ok(((*token).to_owned(), to_token_id(id)?)))
        .collect::<Result<_, TokenizerError>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(false)
        .ignore_merges(false)
        .build()
        .map_err(|e| TokenizerError::Build(format!("BPE from GGUF vocab and merges: {e}")))?;

    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    // The normalizer goes in before the added tokens: setting it later re-normalizes them all.
    tokenizer
        .with_normalizer(Some(NFC))
        .map_err(|e| TokenizerError::Build(e.to_string()))?;
    tokenizer.with_pre_tokenizer(Some(qwen2_pre_tokenizer()?));
    tokenizer.with_post_processor(Some(ByteLevel::new(false, false, false)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, false, false)));

    let mut added = Vec::new();
    let mut control_token_ids = Vec::new();
    for (id, (token, token_type)) in tokens.iter().zip(&token_types).enumerate() {
        let special = match *token_type {
            TOKEN_TYPE_CONTROL => true,
            TOKEN_TYPE_USER_DEFINED => false,
            _ => continue,
        };
        if special {
            control_token_ids.push(to_token_id(id)?);
        }
        added.push(AddedToken::from(*token, special).normalized(false));
    }
    // One call: each call rebuilds the added-token matcher.
    tokenizer
        .add_tokens(added)
        .map_err(|e| TokenizerError::Build(e.to_string()))?;

    let token_id = |key: &str| optional_token_id(metadata, key, tokens.len());
    Ok(GgufTokenizer {
        bos_token_id: token_id("tokenizer.ggml.bos_token_id")?,
        eos_token_id: token_id("tokenizer.ggml.eos_token_id")?,
        padding_token_id: token_id("tokenizer.ggml.padding_token_id")?,
        add_bos_token: optional_bool(metadata, "tokenizer.ggml.add_bos_token")?.unwrap_or(false),
        chat_template: optional_str(metadata, "tokenizer.chat_template")?.map(str::to_owned),
        control_token_ids,
        tokenizer,
    })
}

fn qwen2_pre_tokenizer() -> Result<Sequence, TokenizerError> {
    let split = Split::new(
        SplitPattern::Regex(QWEN2_SPLIT_REGEX.to_owned()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| TokenizerError::Build(format!("Qwen2 pre-tokenizer regex: {e}")))?;
    Ok(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, false, false).into(),
    ]))
}

fn parse_merges(lines: &[&str]) -> Result<Merges, TokenizerError> {
    lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            line.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| {
                    gguf_error(
                        "tokenizer.ggml.merges",
                        format!("entry {i} {line:?} is not \"a b\""),
                    )
                })
        })
        .collect()
}

fn to_token_id(index: usize) -> Result<u32, TokenizerError> {
    u32::try_from(index).map_err(|_| {
        gguf_error(
            "tokenizer.ggml.tokens",
            "has more than 2^32 entries".to_owned(),
        )
    })
}

fn gguf_error(key: &str, reason: String) -> TokenizerError {
    TokenizerError::Gguf {
        key: key.to_owned(),
        reason,
    }
}

fn unsupported(key: &str, value: &str, supported: &str) -> TokenizerError {
    TokenizerError::Unsupported {
        key: key.to_owned(),
        value: value.to_owned(),
        supported: supported.to_owned(),
    }
}

fn required_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<&'a str, TokenizerError> {
    optional_str(md, key)?.ok_or_else(|| gguf_error(key, "is missing".to_owned()))
}

fn optional_str<'a>(
    md: &'a HashMap<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(gguf_error(
            key,
            format!("expected a string, found {:?}", other.value_type()),
        )),
    }
}

fn optional_bool(md: &HashMap<String, Value>, key: &str) -> Result<Option<bool>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(gguf_error(
            key,
            format!("expected a bool, found {:?}", other.value_type()),
        )),
    }
}

fn string_array<'a>(
    md: &'a HashMap<String, Value>,
    key: &str,
) -> Result<Vec<&'a str>, TokenizerError> {
    let Some(value) = md.get(key) else {
        return Err(gguf_error(key, "is missing".to_owned()));
    };
    let Value::Array(items) = value else {
        return Err(gguf_error(key, "expected an array of strings".to_owned()));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::String(s) => Ok(s.as_str()),
            _ => Err(gguf_error(key, format!("entry {i} is not a string"))),
        })
        .collect()
}

fn as_int(value: &Value) -> Option<i64> {
    Some(match value {
        Value::U8(v) => i64::from(*v),
        Value::I8(v) => i64::from(*v),
        Value::U16(v) => i64::from(*v),
        Value::I16(v) => i64::from(*v),
        Value::U32(v) => i64::from(*v),
        Value::I32(v) => i64::from(*v),
        Value::U64(v) => i64::try_from(*v).ok()?,
        Value::I64(v) => *v,
        _ => return None,
    })
}

fn int_array(value: &Value, key: &str) -> Result<Vec<i64>, TokenizerError> {
    let Value::Array(items) = value else {
        return Err(gguf_error(key, "expected an array of integers".to_owned()));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            as_int(item).ok_or_else(|| gguf_error(key, format!("entry {i} is not an integer")))
        })
        .collect()
}

fn optional_token_id(
    md: &HashMap<String, Value>,
    key: &str,
    num_tokens: usize,
) -> Result<Option<u32>, TokenizerError> {
    let Some(value) = md.get(key) else {
        return Ok(None);
    };
    let id = as_int(value).ok_or_else(|| gguf_error(key, "expected an integer".to_owned()))?;
    match usize::try_from(id) {
        Ok(index) if index < num_tokens => Ok(Some(to_token_id(index)?)),
        _ => Err(gguf_error(
            key,
            format!("token id {id} is outside the vocabulary of {num_tokens}"),
        )),
    }
}

/// A tiny GGUF-shaped tokenizer for tests: ids 0..=255 are the 256 bytes (GPT-2 byte-to-unicode
/// spelling, id = byte value), then `<|endoftext|>` 256, `<|im_start|>` 257, `<|im_end|>` 258
/// (control), `<tool_call>` 259 (user-defined), `ab` 260 (the one merge, "a b"). Eos is 258.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// GPT-2's byte-to-unicode map: printable Latin-1 bytes stand for themselves, the others are
    /// shifted to U+0100.. in byte order.
    pub(crate) fn byte_char(byte: u8) -> char {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable(byte) {
            return char::from(byte);
        }
        let shift = (0..byte).filter(|b| !printable(*b)).count();
        char::from_u32(256 + shift as u32).expect("below U+0200")
    }

    pub(crate) fn tiny_metadata() -> HashMap<String, Value> {
        let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
        let mut types = vec![1i32; 256];
        for (token, kind) in [
            ("<|endoftext|>", 3),
            ("<|im_start|>", 3),
            ("<|im_end|>", 3),
            ("<tool_call>", 4),
            ("ab", 1),
        ] {
            tokens.push(token.to_owned());
            types.push(kind);
        }
        let strings =
            |items: Vec<String>| Value::Array(items.into_iter().map(Value::String).collect());
        HashMap::from([
            (
                "tokenizer.ggml.model".to_owned(),
                Value::String("gpt2".to_owned()),
            ),
            (
                "tokenizer.ggml.pre".to_owned(),
                Value::String("qwen2".to_owned()),
            ),
            ("tokenizer.ggml.tokens".to_owned(), strings(tokens)),
            (
                "tokenizer.ggml.token_type".to_owned(),
                Value::Array(types.into_iter().map(Value::I32).collect()),
            ),
            (
                "tokenizer.ggml.merges".to_owned(),
                strings(vec!["a b".to_owned()]),
            ),
            ("tokenizer.ggml.eos_token_id".to_owned(), Value::U32(258)),
            ("tokenizer.ggml.bos_token_id".to_owned(), Value::U32(256)),
            (
                "tokenizer.ggml.add_bos_token".to_owned(),
                Value::Bool(false),
            ),
            (
                "tokenizer.chat_template".to_owned(),
                Value::String("{{ messages }}".to_owned()),
            ),
        ])
    }

    pub(crate) fn tiny_byte_level_tokenizer() -> crate::tokenizer::Tokenizer {
        crate::tokenizer::Tokenizer::from_gguf(&tiny_metadata()).expect("tiny tokenizer builds")
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{tiny_byte_level_tokenizer, tiny_metadata};
    use super::*;
    use crate::tokenizer::Tokenizer;

    #[test]
    fn tiny_vocab_applies_merges_added_tokens_and_byte_level() {
        let tokenizer = tiny_byte_level_tokenizer();
        assert_eq!(
            tokenizer.encode("abc", false).expect("encode"),
            vec![260, 99]
        );
        assert_eq!(
            tokenizer.encode("<tool_call>", false).expect("encode"),
            vec![259]
        );
        assert_eq!(
            tokenizer.encode(" é", false).expect("encode"),
            vec![32, 0xC3, 0xA9]
        );
        assert_eq!(
            tokenizer.decode(&[259, 258], true).expect("decode"),
            "<tool_call>"
        );
        assert_eq!(tokenizer.eos_token_ids(), &[258]);
        assert_eq!(tokenizer.bos_token_id(), Some(256));
        assert_eq!(tokenizer.chat_template(), Some("{{ messages }}"));
        let mut special: Vec<u32> = tokenizer.special_token_ids().iter().copied().collect();
        special.sort_unstable();
        assert_eq!(special, vec![256, 257, 258]);
    }

    #[test]
    fn nfc_normalizes_before_tokenizing() {
        let tokenizer = tiny_byte_level_tokenizer();
        let decomposed = "e\u{301}";
        assert_eq!(
            tokenizer.encode(decomposed, false).expect("encode"),
            vec![0xC3, 0xA9]
        );
    }

    #[test]
    fn control_ids_and_bos_prepend_follow_metadata() {
        let mut md = tiny_metadata();
        let built = build(&md).expect("build");
        assert_eq!(built.control_token_ids, vec![256, 257, 258]);
        md.insert("tokenizer.ggml.add_bos_token".to_owned(), Value::Bool(true));
        let tokenizer = Tokenizer::from_gguf(&md).expect("build");
        assert_eq!(tokenizer.encode("a", true).expect("encode"), vec![256, 97]);
        assert_eq!(tokenizer.encode("a", false).expect("encode"), vec![97]);
    }

    #[test]
    fn unsupported_model_and_pre_are_named() {
        let mut md = tiny_metadata();
        md.insert(
            "tokenizer.ggml.pre".to_owned(),
            Value::String("llama-bpe".to_owned()),
        );
        let err = build(&md).expect_err("unsupported pre").to_string();
        assert!(
            err.contains("tokenizer.ggml.pre") && err.contains("llama-bpe"),
            "{err}"
        );
        md.insert(
            "tokenizer.ggml.model".to_owned(),
            Value::String("llama".to_owned()),
        );
        let err = build(&md).expect_err("unsupported model").to_string();
        assert!(
            err.contains("tokenizer.ggml.model") && err.contains("\"llama\""),
            "{err}"
        );
    }

    #[test]
    fn malformed_metadata_is_named() {
        let mut md = tiny_metadata();
        md.insert(
            "tokenizer.ggml.merges".to_owned(),
            Value::Array(vec![Value::String("ab".to_owned())]),
        );
        let err = build(&md).expect_err("bad merge").to_string();
        assert!(
            err.contains("tokenizer.ggml.merges") && err.contains("\"ab\""),
            "{err}"
        );

        let mut md = tiny_metadata();
        md.insert("tokenizer.ggml.eos_token_id".to_owned(), Value::U32(9999));
        let err = build(&md).expect_err("eos out of range").to_string();
        assert!(
            err.contains("eos_token_id") && err.contains("9999"),
            "{err}"
        );

        let mut md = tiny_metadata();
        md.remove("tokenizer.ggml.tokens");
        let err = build(&md).expect_err("no tokens").to_string();
        assert!(
            err.contains("tokenizer.ggml.tokens") && err.contains("missing"),
            "{err}"
        );
    }
}

/// Checks against the real Qwen2.5-Coder-0.5B-Instruct GGUF; each test returns early with a note
/// when the file is not cached.
#[cfg(test)]
pub(crate) mod real_model_tests {
    use std::path::PathBuf;

    use candle_core::quantized::gguf_file::Content;

    use crate::tokenizer::Tokenizer;

    const FILE_NAME: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

    pub(crate) fn demo_gguf_path() -> Option<PathBuf> {
        let home = std::env::var_os("NOVAINFER_HOME")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/novainfer"))
            })?;
        let path = home.join("models").join(FILE_NAME);
        path.is_file().then_some(path)
    }

    pub(crate) fn demo_tokenizer() -> Option<Tokenizer> {
        let Some(path) = demo_gguf_path() else {
            eprintln!("skipped: {FILE_NAME} is not in the model cache");
            return None;
        };
        let mut file = std::fs::File::open(&path).expect("open demo GGUF");
        let content = Content::read(&mut file).expect("read GGUF header");
        let start = std::time::Instant::now();
        let tokenizer = Tokenizer::from_gguf(&content.metadata).expect("build tokenizer");
        eprintln!("built GGUF tokenizer in {:?}", start.elapsed());
        Some(tokenizer)
    }

    #[test]
    fn known_qwen25_encodings() {
        let Some(tokenizer) = demo_tokenizer() else {
            return;
        };
        let cases: &[(&str, &[u32])] = &[
            ("Hello world", &[9707, 1879]),
            ("<|im_start|>", &[151644]),
            ("<|im_end|>", &[151645]),
            ("<|endoftext|>", &[151643]),
            ("12345", &[16, 17, 18, 19, 20]),
        ];
        for (text, ids) in cases {
            assert_eq!(
                tokenizer.encode(text, true).expect("encode"),
                *ids,
                "{text:?}"
            );
        }
        assert_eq!(tokenizer.eos_token_ids(), &[151645]);
        assert!(tokenizer.is_special(151644) && tokenizer.is_special(151643));
        assert!(tokenizer
            .chat_template()
            .is_some_and(|t| t.contains("<|im_start|>")));
    }

    #[test]
    fn real_vocab_round_trips_mixed_text() {
        let Some(tokenizer) = demo_tokenizer() else {
            return;
        };
        for text in [
            "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))",
            "你好，世界！今天天气很好。",
            "emoji 🤖🚀 and 👩‍💻",
            "<|im_start|>user\nhi<|im_end|>\n",
        ] {
            let ids = tokenizer.encode(text, false).expect("encode");
            assert_eq!(tokenizer.decode(&ids, false).expect("decode"), text);
        }
        let ids = tokenizer
            .encode("<|im_start|>user\nhi<|im_end|>", false)
            .expect("encode");
        assert_eq!(ids.first(), Some(&151644));
        assert_eq!(ids.last(), Some(&151645));
    }
}
