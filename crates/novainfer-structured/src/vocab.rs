//! The model's vocabulary as llguidance sees it: each token id's exact bytes.
//!
//! Built from our own `tokenizers::Tokenizer` (which both a `tokenizer.json` and GGUF metadata
//! produce), not with `toktrie_hf_tokenizers`, which pins an older `tokenizers`.
//! Special tokens are spelt `0xFF` + their text, llguidance's marker for "not text": a grammar
//! can then never produce `<|im_end|>` by spelling it, only name it (`<|im_end|>` in Lark).

use std::collections::HashSet;
use std::sync::Arc;

use tokenizers::{DecoderWrapper, Tokenizer};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::StructuredError;

/// The byte each character of GPT-2's byte-level alphabet stands for (`Ġ` is a space).
fn byte_level_alphabet() -> [Option<u8>; 324] {
    let mut table = [None; 324];
    let mut extra = 0usize;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let ch = if printable {
            b as usize
        } else {
            extra += 1;
            255 + extra
        };
        table[ch] = Some(b);
    }
    table
}

/// Bytes of `token` in byte-level BPE spelling; `None` if a character is outside the alphabet.
fn byte_level_bytes(token: &str, alphabet: &[Option<u8>; 324]) -> Option<Vec<u8>> {
    token
        .chars()
        .map(|c| alphabet.get(c as usize).copied().flatten())
        .collect()
}

/// Bytes of a token of a non-byte-level tokenizer (SentencePiece style): `<0x0A>` is that byte,
/// `▁` a space; anything else is its text.
fn piece_bytes(tokenizer: &Tokenizer, id: u32, piece: &str) -> Vec<u8> {
    if let Some(hex) = piece
        .strip_prefix("<0x")
        .and_then(|rest| rest.strip_suffix('>'))
    {
        if let Ok(b) = u8::from_str_radix(hex, 16) {
            return vec![b];
        }
    }
    if piece.contains('\u{2581}') {
        return piece.replace('\u{2581}', " ").into_bytes();
    }
    tokenizer
        .decode(&[id], false)
        .map(String::into_bytes)
        .unwrap_or_else(|_| piece.as_bytes().to_vec())
}

/// Each id's bytes, `0..=max id`; ids the tokenizer does not know are empty (never allowed).
pub fn token_bytes(tokenizer: &Tokenizer) -> Vec<Vec<u8>> {
    let vocab = tokenizer.get_vocab(true);
    let size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
    let mut words = vec![Vec::new(); size];
    let byte_level = matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
    let alphabet = byte_level_alphabet();
    let added = tokenizer.get_added_tokens_decoder();
    for (piece, id) in vocab {
        let bytes = match added.get(&id) {
            Some(token) if token.special => {
                let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                b.extend_from_slice(token.content.as_bytes());
                b
            }
            // Added but not special (Qwen's `<tool_call>`): plain text the model may write.
            Some(token) => token.content.as_bytes().to_vec(),
            None if byte_level => {
                byte_level_bytes(&piece, &alphabet).unwrap_or_else(|| piece.as_bytes().to_vec())
            }
            None => piece_bytes(tokenizer, id, &piece),
        };
        words[id as usize] = bytes;
    }
    words
}

/// llguidance's view of the tokenizer: the trie of token bytes, and real tokenization for the
/// strings a grammar forces.
struct Env {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => match self.tokenizer.encode_fast(text, false) {
                Ok(enc) => enc.get_ids().to_vec(),
                Err(_) => self.trie.greedy_tokenize(s),
            },
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Builds llguidance's tokenizer environment. `eos_token_ids` (first: the tokenizer's own) are
/// the ids that end a sequence: allowed exactly where the grammar accepts.
pub fn tok_env(tokenizer: &Tokenizer, eos_token_ids: &[u32]) -> Result<TokEnv, StructuredError> {
    let words = token_bytes(tokenizer);
    let size = words.len();
    let known: HashSet<u32> = eos_token_ids
        .iter()
        .copied()
        .filter(|&id| (id as usize) < size)
        .collect();
    let Some(&first) = eos_token_ids.iter().find(|id| known.contains(id)) else {
        return Err(StructuredError::Setup(
            "the tokenizer has no end-of-sequence token, so no output could be ended".into(),
        ));
    };
    let eos: Vec<u32> = eos_token_ids
        .iter()
        .copied()
        .filter(|id| known.contains(id))
        .collect();
    let info = TokRxInfo::new(size as u32, first);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
    Ok(Arc::new(Env {
        trie,
        tokenizer: tokenizer.clone(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_round_trips_every_byte() {
        let alphabet = byte_level_alphabet();
        let mapped: Vec<u8> = alphabet.iter().flatten().copied().collect();
        assert_eq!(mapped.len(), 256);
        assert_eq!(
            byte_level_bytes("\u{120}hello", &alphabet),
            Some(b" hello".to_vec())
        );
        assert_eq!(byte_level_bytes("\u{10a}", &alphabet), Some(b"\n".to_vec()));
        assert_eq!(byte_level_bytes("\u{4e2d}", &alphabet), None);
    }
}
