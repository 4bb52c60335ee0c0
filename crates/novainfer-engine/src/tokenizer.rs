//! The tokenizer the engine generates with: a `tokenizers::Tokenizer` plus the special-token facts
//! generation needs (eos ids, bos id, which ids are special) and the model's chat template source.
//!
//! Two sources: a Hugging Face model directory (`tokenizer.json`, `tokenizer_config.json`,
//! `generation_config.json`, `chat_template.jinja`) and GGUF metadata (see `gguf_tokenizer`).
//! Invariants: every id in `eos_token_ids`, `bos_token_id` and `special_token_ids` is known to the
//! wrapped tokenizer; `eos_token_ids` has no duplicates and its first entry (if any) is the
//! tokenizer's own eos token, the one the chat template sees as `eos_token`.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use candle_core::quantized::gguf_file;
use serde_json::Value as Json;

use crate::gguf_tokenizer;
pub use crate::tokenizer_error::TokenizerError;

/// What generation needs to know about special tokens, beyond the vocabulary itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos_token_id: Option<u32>,
    /// The first id is the tokenizer's own eos token; the rest (e.g. from `generation_config.json`)
    /// also end generation.
    pub eos_token_ids: Vec<u32>,
    /// Prepend `bos_token_id` when encoding with special tokens. Only the GGUF path sets this: a
    /// `tokenizer.json` already encodes its BOS rule in its post-processor, and doing it twice
    /// would double the BOS.
    pub prepend_bos: bool,
}

#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialTokens,
    special_token_ids: HashSet<u32>,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Wraps a built tokenizer. Ids in `special` must exist in `inner`; the special-id set is
    /// every added token marked `special` (what `skip_special_tokens` skips).
    pub fn new(
        inner: tokenizers::Tokenizer,
        special: SpecialTokens,
        chat_template: Option<String>,
    ) -> Result<Tokenizer, TokenizerError> {
        let special_token_ids = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        let mut tokenizer = Tokenizer {
            inner,
            special: SpecialTokens {
                eos_token_ids: Vec::new(),
                ..special.clone()
            },
            special_token_ids,
            chat_template,
        };
        for id in special.bos_token_id.iter().chain(&special.eos_token_ids) {
            tokenizer.check_known_id(*id)?;
        }
        tokenizer.extend_eos_token_ids(&special.eos_token_ids)?;
        Ok(tokenizer)
    }

    /// Loads `tokenizer.json` from a Hugging Face model directory, with special tokens from
    /// `tokenizer_config.json` and extra eos ids from `generation_config.json` when present.
    /// The chat template comes from `chat_template.jinja` if it exists, else from
    /// `tokenizer_config.json` (transformers lets the file clobber the config the same way).
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.is_file() {
            return Err(TokenizerError::Io {
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
                path: tokenizer_path,
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&tokenizer_path).map_err(|e| {
            TokenizerError::Load {
                path: tokenizer_path.clone(),
                message: e.to_string(),
            }
        })?;
        let config = read_json_if_present(&dir.join("tokenizer_config.json"))?;
        let generation = read_json_if_present(&dir.join("generation_config.json"))?;

        let lookup =
            |file: &str, field: &str, token: Option<String>| -> Result<_, TokenizerError> {
                token
                    .map(|token| {
                        inner
                            .token_to_id(&token)
                            .ok_or_else(|| TokenizerError::UnknownToken {
                                source_name: file.to_owned(),
                                field: field.to_owned(),
                                token,
                            })
                    })
                    .transpose()
            };
        let config_file = "tokenizer_config.json";
        let (bos_token, eos_token, mut chat_template) = match &config {
            Some(config) => (
                token_field(config, config_file, "bos_token")?,
                token_field(config, config_file, "eos_token")?,
                chat_template_field(config, config_file)?,
            ),
            None => (None, None, None),
        };
        let bos_token_id = lookup(config_file, "bos_token", bos_token)?;
        let mut eos_token_ids: Vec<u32> = lookup(config_file, "eos_token", eos_token)?
            .into_iter()
            .collect();
        if let Some(generation) = &generation {
            eos_token_ids.extend(generation_eos_ids(generation)?);
        }

        let template_path = dir.join("chat_template.jinja");
        if template_path.is_file() {
            let text =
                std::fs::read_to_string(&template_path).map_err(|source| TokenizerError::Io {
                    path: template_path,
                    source,
                })?;
            chat_template = Some(text);
        }
        let special = SpecialTokens {
            bos_token_id,
            eos_token_ids,
            prepend_bos: false,
        };
        Tokenizer::new(inner, special, chat_template)
    }

    /// Builds the tokenizer llama.cpp describes in GGUF metadata (`tokenizer.ggml.*`).
    pub fn from_gguf(
        metadata: &HashMap<String, gguf_file::Value>,
    ) -> Result<Tokenizer, TokenizerError> {
        let built = gguf_tokenizer::build(metadata)?;
        let special = SpecialTokens {
            bos_token_id: built.bos_token_id,
            eos_token_ids: built.eos_token_id.into_iter().collect(),
            prepend_bos: built.add_bos_token && built.bos_token_id.is_some(),
        };
        Tokenizer::new(built.tokenizer, special, built.chat_template)
    }

    /// Adds eos ids the tokenizer files do not know (e.g. `generation_config.json`'s list),
    /// keeping the first eos id and skipping duplicates.
    pub fn extend_eos_token_ids(&mut self, ids: &[u32]) -> Result<(), TokenizerError> {
        for &id in ids {
            self.check_known_id(id)?;
            if !self.special.eos_token_ids.contains(&id) {
                self.special.eos_token_ids.push(id);
            }
        }
        Ok(())
    }

    /// Token ids for `text`. Added tokens written in the text (`<|im_start|>`) become their ids;
    /// `add_special_tokens` applies the tokenizer's BOS/post-processing rule.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        let ids = encoding.get_ids();
        match self.special.bos_token_id {
            Some(bos) if add_special_tokens && self.special.prepend_bos => {
                let mut with_bos = Vec::with_capacity(ids.len() + 1);
                with_bos.push(bos);
                with_bos.extend_from_slice(ids);
                Ok(with_bos)
            }
            _ => Ok(ids.to_vec()),
        }
    }

    /// Text for `ids`; invalid UTF-8 (a character cut between tokens) decodes to U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// The vocabulary entry for `id`, in the model's own spelling (byte-level BPE: `Ġ` for space).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of ids the tokenizer knows, added tokens included. The model's embedding may
    /// have more rows (Qwen2 pads to 151,936).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.special.eos_token_ids
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.special.bos_token_id
    }

    /// The eos token's text, as the chat template sees it.
    pub fn eos_token(&self) -> Option<String> {
        self.special
            .eos_token_ids
            .first()
            .and_then(|&id| self.id_to_token(id))
    }

    pub fn bos_token(&self) -> Option<String> {
        self.special
            .bos_token_id
            .and_then(|id| self.id_to_token(id))
    }

    /// The raw bytes token `id` stands for: for byte-level BPE the vocabulary entry mapped back
    /// through GPT-2's byte-to-character table, so a token holding part of a UTF-8 character
    /// gives that part (decoding it alone would give U+FFFD); `<0xHH>` byte-fallback tokens give
    /// their byte; added tokens and anything else give their decoded text.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let added = self.inner.get_added_tokens_decoder();
        if let Some(token) = added.get(&id) {
            return token.content.clone().into_bytes();
        }
        let byte_level = matches!(
            self.inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        if let Some(piece) = self.id_to_token(id) {
            if byte_level {
                if let Some(bytes) = piece.chars().map(byte_of_char).collect::<Option<Vec<u8>>>() {
                    return bytes;
                }
            }
            if let Some(hex) = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
                if let Ok(b) = u8::from_str_radix(hex, 16) {
                    return vec![b];
                }
            }
        }
        self.decode(&[id], false).unwrap_or_default().into_bytes()
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special_token_ids.contains(&id)
    }

    /// Ids of added tokens marked special (GGUF: token type "control").
    pub fn special_token_ids(&self) -> &HashSet<u32> {
        &self.special_token_ids
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    fn check_known_id(&self, id: u32) -> Result<(), TokenizerError> {
        if self.inner.id_to_token(id).is_some() {
            Ok(())
        } else {
            Err(TokenizerError::Build(format!(
                "special token id {id} is not in the vocabulary"
            )))
        }
    }
}

/// The byte GPT-2's byte-level alphabet writes as `c`: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes are written as U+0100.. in byte order.
fn byte_of_char(c: char) -> Option<u8> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let code = c as u32;
    if printable(code) {
        return Some(code as u8);
    }
    let n = code.checked_sub(256)?;
    (0u32..=255)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

fn read_json_if_present(path: &Path) -> Result<Option<Json>, TokenizerError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TokenizerError::Json {
            path: path.to_owned(),
            source,
        })
}

/// `bos_token`/`eos_token` in `tokenizer_config.json`: a string, an `AddedToken` object
/// (`{"content": ...}`), or null/absent.
fn token_field(config: &Json, file: &str, field: &str) -> Result<Option<String>, TokenizerError> {
    let bad = |reason: &str| TokenizerError::Field {
        file: file.to_owned(),
        field: field.to_owned(),
        reason: reason.to_owned(),
    };
    match config.get(field) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(obj)) => match obj.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(bad("is an object without a string `content`")),
        },
        Some(_) => Err(bad("must be a string or an object with `content`")),
    }
}

/// `chat_template`: a string, or a list of `{name, template}` from which "default" is taken.
/// A list without "default" yields no template (transformers refuses to pick one either).
fn chat_template_field(config: &Json, file: &str) -> Result<Option<String>, TokenizerError> {
    let bad = |reason: &str| TokenizerError::Field {
        file: file.to_owned(),
        field: "chat_template".to_owned(),
        reason: reason.to_owned(),
    };
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(entries)) => {
            for entry in entries {
                let name = entry.get("name").and_then(Json::as_str);
                let template = entry.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some("default"), Some(template)) => return Ok(Some(template.to_owned())),
                    (Some(_), Some(_)) => {}
                    _ => return Err(bad("has an entry without string `name` and `template`")),
                }
            }
            Ok(None)
        }
        Some(_) => Err(bad("must be a string or a list of {name, template}")),
    }
}

/// `eos_token_id` in `generation_config.json`: an integer or a list of integers.
fn generation_eos_ids(generation: &Json) -> Result<Vec<u32>, TokenizerError> {
    let bad = || TokenizerError::Field {
        file: "generation_config.json".to_owned(),
        field: "eos_token_id".to_owned(),
        reason: "must be a token id or a list of token ids".to_owned(),
    };
    let as_id = |v: &Json| {
        v.as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(bad)
    };
    match generation.get("eos_token_id") {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::Array(ids)) => ids.iter().map(as_id).collect(),
        Some(id) => Ok(vec![as_id(id)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_tokenizer::test_support::tiny_byte_level_tokenizer;

    #[test]
    fn token_bytes_are_raw_even_for_part_of_a_character() {
        let tokenizer = tiny_byte_level_tokenizer();
        let ids = tokenizer.encode("é ", false).expect("encode");
        assert_eq!(ids.len(), 3, "one token per byte");
        assert_eq!(tokenizer.token_bytes(ids[0]), vec![0xC3]);
        assert_eq!(tokenizer.token_bytes(ids[1]), vec![0xA9]);
        assert_eq!(tokenizer.token_bytes(ids[2]), b" ".to_vec());
        assert_eq!(
            tokenizer.decode(&ids[..1], false).expect("decode"),
            "\u{FFFD}"
        );
        let end = tokenizer.encode("<|im_end|>", false).expect("encode");
        assert_eq!(tokenizer.token_bytes(end[0]), b"<|im_end|>".to_vec());
        for b in 0..=255u8 {
            let c = (0u32..)
                .filter_map(char::from_u32)
                .find(|&c| byte_of_char(c) == Some(b));
            assert!(c.is_some(), "byte {b} has a character");
        }
    }

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).expect("write test file");
    }

    fn hf_dir_with_tiny_tokenizer() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let json = tiny_byte_level_tokenizer()
            .inner()
            .to_string(false)
            .expect("serialize");
        write(dir.path(), "tokenizer.json", &json);
        dir
    }

    #[test]
    fn missing_tokenizer_json_names_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = Tokenizer::from_hf_dir(dir.path()).expect_err("no tokenizer.json");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn hf_dir_reads_special_tokens_and_template_list() {
        let dir = hf_dir_with_tiny_tokenizer();
        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"bos_token": null,
                "eos_token": {"content": "<|im_end|>", "special": true},
                "chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}]}"#,
        );
        write(
            dir.path(),
            "generation_config.json",
            r#"{"eos_token_id": [258, 257]}"#,
        );
        let tokenizer = Tokenizer::from_hf_dir(dir.path()).expect("load");
        assert_eq!(tokenizer.eos_token_ids(), &[258, 257]);
        assert_eq!(tokenizer.eos_token().as_deref(), Some("<|im_end|>"));
        assert_eq!(tokenizer.bos_token_id(), None);
        assert_eq!(tokenizer.chat_template(), Some("D"));
        assert!(tokenizer.is_special(258) && !tokenizer.is_special(65));
    }

    #[test]
    fn chat_template_file_wins_over_config() {
        let dir = hf_dir_with_tiny_tokenizer();
        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"eos_token": "<|im_end|>", "chat_template": "C"}"#,
        );
        write(dir.path(), "chat_template.jinja", "F");
        let tokenizer = Tokenizer::from_hf_dir(dir.path()).expect("load");
        assert_eq!(tokenizer.chat_template(), Some("F"));
    }

    #[test]
    fn unknown_eos_token_is_named() {
        let dir = hf_dir_with_tiny_tokenizer();
        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"eos_token": "</s>"}"#,
        );
        let err = Tokenizer::from_hf_dir(dir.path()).expect_err("unknown eos");
        let text = err.to_string();
        assert!(
            text.contains("eos_token") && text.contains("</s>"),
            "{text}"
        );
    }

    #[test]
    fn malformed_eos_field_is_named() {
        let dir = hf_dir_with_tiny_tokenizer();
        write(dir.path(), "tokenizer_config.json", r#"{"eos_token": 5}"#);
        let err = Tokenizer::from_hf_dir(dir.path()).expect_err("bad eos");
        assert!(err.to_string().contains("`eos_token`"), "{err}");
    }

    #[test]
    fn special_tokens_in_text_encode_to_their_ids() {
        let tokenizer = tiny_byte_level_tokenizer();
        let ids = tokenizer
            .encode("<|im_start|>hi<|im_end|>", false)
            .expect("encode");
        assert_eq!(ids, vec![257, u32::from(b'h'), u32::from(b'i'), 258]);
        assert_eq!(tokenizer.decode(&ids, true).expect("decode"), "hi");
        assert_eq!(
            tokenizer.decode(&ids, false).expect("decode"),
            "<|im_start|>hi<|im_end|>"
        );
    }

    #[test]
    fn extend_eos_keeps_order_and_rejects_unknown_ids() {
        let mut tokenizer = tiny_byte_level_tokenizer();
        tokenizer
            .extend_eos_token_ids(&[256, 258, 256])
            .expect("known ids");
        assert_eq!(tokenizer.eos_token_ids(), &[258, 256]);
        assert!(tokenizer.extend_eos_token_ids(&[1_000_000]).is_err());
    }
}
