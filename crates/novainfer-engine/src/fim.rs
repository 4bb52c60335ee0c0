//! Fill-in-the-middle prompts, built from the FIM tokens of the model's own vocabulary.
//!
//! Qwen2.5-Coder (and StarCoder-style models) were trained on
//! `<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>` and continue with the middle.
//! The repo-level form, for llama.cpp's `/infill` with `input_extra`, puts other files first:
//! `<|repo_name|>myproject\n<|file_sep|>{filename}\n{text}...` (llama.cpp's layout; without the
//! repo tokens the chunks' text simply comes first).
//!
//! Prompts are assembled from token ids: each text piece is encoded on its own (special-token
//! text inside it is read as that token, as when the same prompt is sent as one string), so a
//! FIM request gives exactly the ids of its raw FIM prompt string.

use crate::tokenizer::{Tokenizer, TokenizerError};

/// Spellings of each FIM token: Qwen2.5-Coder's first, then StarCoder's.
const PREFIX: &[&str] = &["<|fim_prefix|>", "<fim_prefix>"];
const SUFFIX: &[&str] = &["<|fim_suffix|>", "<fim_suffix>"];
const MIDDLE: &[&str] = &["<|fim_middle|>", "<fim_middle>"];
const REPO_NAME: &[&str] = &["<|repo_name|>", "<reponame>"];
const FILE_SEP: &[&str] = &["<|file_sep|>", "<file_sep>"];
const PAD: &[&str] = &["<|fim_pad|>", "<fim_pad>"];

/// The project name llama.cpp writes after `<|repo_name|>` (editor plugins send none).
const REPO: &str = "myproject";

/// The FIM tokens of a vocabulary that has the three required ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FimTokens {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
    pub repo_name: Option<u32>,
    pub file_sep: Option<u32>,
    pub pad: Option<u32>,
}

/// One `input_extra` chunk: another file's text, for repo-level context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtraChunk {
    pub filename: String,
    pub text: String,
}

/// An infill prompt and whether its extra context had to be cut to fit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfillPrompt {
    pub token_ids: Vec<u32>,
    /// Tokens of `input_extra` left out (the oldest first) to keep `max_prompt_tokens`.
    pub extra_tokens_dropped: usize,
}

fn lookup(tokenizer: &Tokenizer, spellings: &[&str]) -> Option<u32> {
    spellings.iter().find_map(|s| tokenizer.token_to_id(s))
}

impl FimTokens {
    /// `None` when the vocabulary lacks a prefix, suffix or middle token.
    pub fn of(tokenizer: &Tokenizer) -> Option<FimTokens> {
        Some(FimTokens {
            prefix: lookup(tokenizer, PREFIX)?,
            suffix: lookup(tokenizer, SUFFIX)?,
            middle: lookup(tokenizer, MIDDLE)?,
            repo_name: lookup(tokenizer, REPO_NAME),
            file_sep: lookup(tokenizer, FILE_SEP),
            pad: lookup(tokenizer, PAD),
        })
    }

    /// Every FIM token: none of them belongs in a middle, so llama.cpp ends an infill on any.
    pub fn all(&self) -> Vec<u32> {
        [self.prefix, self.suffix, self.middle]
            .into_iter()
            .chain(self.repo_name)
            .chain(self.file_sep)
            .chain(self.pad)
            .collect()
    }

    /// `prefix`, `suffix` (and the text the middle starts with) in FIM order, preceded by the
    /// BOS the tokenizer adds to a prompt, if it adds one.
    pub fn prompt(
        &self,
        tokenizer: &Tokenizer,
        prefix: &str,
        suffix: &str,
        middle_start: &str,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = bos(tokenizer)?;
        ids.push(self.prefix);
        ids.extend(tokenizer.encode(prefix, false)?);
        ids.push(self.suffix);
        ids.extend(tokenizer.encode(suffix, false)?);
        ids.push(self.middle);
        ids.extend(tokenizer.encode(middle_start, false)?);
        Ok(ids)
    }

    /// llama.cpp's `/infill` prompt: the extra chunks (repo-level form where the vocabulary
    /// has the tokens), then the FIM prompt with `prompt` after the middle token. When the
    /// whole would exceed `max_prompt_tokens`, the extra context is cut from its start (the
    /// most recent chunks are kept, as llama.cpp keeps them); the FIM part is never cut.
    pub fn infill(
        &self,
        tokenizer: &Tokenizer,
        extra: &[ExtraChunk],
        prefix: &str,
        suffix: &str,
        prompt: &str,
        max_prompt_tokens: usize,
    ) -> Result<InfillPrompt, TokenizerError> {
        let mut extra_ids = Vec::new();
        if let Some(repo) = self.repo_name {
            extra_ids.push(repo);
            extra_ids.extend(tokenizer.encode(&format!("{REPO}\n"), false)?);
        }
        for chunk in extra {
            if let Some(sep) = self.file_sep {
                extra_ids.push(sep);
                extra_ids.extend(tokenizer.encode(&format!("{}\n", chunk.filename), false)?);
            }
            extra_ids.extend(tokenizer.encode(&chunk.text, false)?);
        }
        let fim = self.prompt(tokenizer, prefix, suffix, prompt)?;
        let room = max_prompt_tokens.saturating_sub(fim.len());
        let dropped = extra_ids.len().saturating_sub(room);
        // BOS (if any) stays first: the extra context goes right after it.
        let num_bos = fim.iter().take_while(|&&id| id != self.prefix).count();
        let mut token_ids = fim[..num_bos].to_vec();
        token_ids.extend_from_slice(&extra_ids[dropped..]);
        token_ids.extend_from_slice(&fim[num_bos..]);
        Ok(InfillPrompt {
            token_ids,
            extra_tokens_dropped: dropped,
        })
    }
}

/// What `encode(text, add_special_tokens = true)` puts before the text: the BOS, if the
/// tokenizer adds one (Qwen2 adds none).
fn bos(tokenizer: &Tokenizer) -> Result<Vec<u32>, TokenizerError> {
    let with = tokenizer.encode("a", true)?;
    let without = tokenizer.encode("a", false)?;
    Ok(with
        .strip_suffix(without.as_slice())
        .map(<[u32]>::to_vec)
        .unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_tokenizer::real_model_tests::demo_tokenizer;
    use crate::gguf_tokenizer::test_support::tiny_byte_level_tokenizer;

    #[test]
    fn a_vocabulary_without_fim_tokens_has_none() {
        assert_eq!(FimTokens::of(&tiny_byte_level_tokenizer()), None);
    }

    #[test]
    fn the_demo_model_prompt_equals_its_raw_fim_string() {
        let Some(tokenizer) = demo_tokenizer() else {
            return;
        };
        let fim = FimTokens::of(&tokenizer).expect("Qwen2.5-Coder has FIM tokens");
        assert_eq!(
            (
                fim.prefix,
                fim.suffix,
                fim.middle,
                fim.repo_name,
                fim.file_sep,
                fim.pad
            ),
            (
                151659,
                151661,
                151660,
                Some(151663),
                Some(151664),
                Some(151662)
            )
        );
        let (prefix, suffix) = ("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n");
        let raw = format!("<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>");
        assert_eq!(
            fim.prompt(&tokenizer, prefix, suffix, "").expect("prompt"),
            tokenizer.encode(&raw, true).expect("encode")
        );
        let extra = [
            ExtraChunk {
                filename: "a.py".into(),
                text: "x = 1\n".into(),
            },
            ExtraChunk {
                filename: "b.py".into(),
                text: "y = 2\n".into(),
            },
        ];
        let whole = fim
            .infill(&tokenizer, &extra, prefix, suffix, "return", 10_000)
            .expect("infill");
        let raw = format!(
            "<|repo_name|>myproject\n<|file_sep|>a.py\nx = 1\n<|file_sep|>b.py\ny = 2\n{raw}return"
        );
        assert_eq!(
            whole.token_ids,
            tokenizer.encode(&raw, true).expect("encode")
        );
        assert_eq!(whole.extra_tokens_dropped, 0);
        let fim_only = fim
            .prompt(&tokenizer, prefix, suffix, "return")
            .expect("prompt");
        let cut = fim
            .infill(
                &tokenizer,
                &extra,
                prefix,
                suffix,
                "return",
                fim_only.len() + 3,
            )
            .expect("infill");
        assert_eq!(cut.token_ids.len(), fim_only.len() + 3);
        assert!(cut.token_ids.ends_with(&fim_only));
        assert_eq!(
            cut.extra_tokens_dropped,
            whole.token_ids.len() - cut.token_ids.len()
        );
    }
}
