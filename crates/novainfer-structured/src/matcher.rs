//! One request's position in its grammar: the token mask for the next step, and advancing by
//! the sampled token. [`Constraint`] adds computing the next mask on a worker thread while the
//! engine runs the forward pass, joined just before sampling.

use std::sync::{mpsc, OnceLock};

use llguidance::Matcher;
use toktrie::SimpleVob;

use crate::StructuredError;

/// What the grammar says after a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// More output is allowed (and maybe needed).
    Continue,
    /// The grammar is complete and allows nothing more: the request ends here (`stop`).
    Finished,
}

/// A matcher and the mask it computed for the next token, if any.
pub struct GrammarMatcher {
    matcher: Matcher,
    mask: Option<SimpleVob>,
}

impl GrammarMatcher {
    pub(crate) fn new(matcher: Matcher) -> Self {
        Self {
            matcher,
            mask: None,
        }
    }

    fn error(&self, fallback: impl std::fmt::Display) -> StructuredError {
        StructuredError::Matcher(
            self.matcher
                .get_error()
                .unwrap_or_else(|| fallback.to_string()),
        )
    }

    /// Computes the mask of the next token (once per token: later calls reuse it).
    pub fn compute_mask(&mut self) -> Result<(), StructuredError> {
        if self.mask.is_none() {
            let mask = self.matcher.compute_mask().map_err(|e| self.error(e))?;
            self.mask = Some(mask);
        }
        Ok(())
    }

    /// Sets every logit the grammar forbids to `-inf` (ids past the vocabulary too). Fails when
    /// the grammar allows no token at all, which only a broken matcher does.
    pub fn apply_mask(&mut self, logits: &mut [f32]) -> Result<(), StructuredError> {
        mask_logits(self.allowed()?, logits);
        Ok(())
    }

    /// The next token's mask as words of 32 ids, computed if needed; an error when the
    /// grammar allows no token at all, which only a broken matcher does.
    fn allowed(&mut self) -> Result<&[u32], StructuredError> {
        self.compute_mask()?;
        let mask = self
            .mask
            .as_ref()
            .expect("computed just above: this is a bug");
        if mask.is_zero() {
            return Err(StructuredError::Matcher(
                "the grammar allows no token here".into(),
            ));
        }
        Ok(mask.as_slice())
    }

    /// The next token's mask as words of 32 ids (bit `i % 32` of word `i / 32` set when id
    /// `i` is allowed), for a device that masks the row itself. Fails as
    /// [`Self::apply_mask`] does when the grammar allows no token.
    pub fn mask_words(&mut self) -> Result<Vec<u32>, StructuredError> {
        Ok(self.allowed()?.to_vec())
    }

    /// Advances past `token` (which the mask allowed); [`Progress::Finished`] when the grammar
    /// is complete and can take nothing more.
    pub fn accept(&mut self, token: u32) -> Result<Progress, StructuredError> {
        self.mask = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| self.error(e))?;
        Ok(if self.matcher.is_stopped() {
            Progress::Finished
        } else {
            Progress::Continue
        })
    }

    /// Whether the output so far is a complete match (the grammar would allow ending here).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// How many of `tokens`, in order from here, the grammar allows (the state is unchanged).
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }
}

/// `-inf` for every id whose bit in `words` (32 ids a word) is clear, and for ids past them.
fn mask_logits(words: &[u32], logits: &mut [f32]) {
    for (chunk, &word) in logits.chunks_mut(32).zip(words) {
        match word {
            u32::MAX => {}
            0 => chunk.fill(f32::NEG_INFINITY),
            _ => {
                for (bit, x) in chunk.iter_mut().enumerate() {
                    if word & (1 << bit) == 0 {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
    let covered = (words.len() * 32).min(logits.len());
    logits[covered..].fill(f32::NEG_INFINITY);
}

/// A request's grammar state, whose next mask may be under way on a worker thread.
pub struct Constraint {
    state: State,
}

enum State {
    Ready(Box<GrammarMatcher>),
    /// A worker holds the matcher and sends it back with its mask computed.
    Computing(mpsc::Receiver<(Box<GrammarMatcher>, Result<(), StructuredError>)>),
    /// A worker died with the matcher (a panic inside llguidance).
    Lost,
}

/// Mask workers: few, apart from the pool the model's forward pass uses, so a mask never waits
/// for a whole forward pass to free a thread.
fn mask_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 4);
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("novainfer-mask-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

impl Constraint {
    pub fn new(matcher: GrammarMatcher) -> Self {
        Self {
            state: State::Ready(Box::new(matcher)),
        }
    }

    /// Starts computing the next mask on a worker; [`Self::apply_mask`] waits for it. Without
    /// a worker pool the mask is computed at sampling time instead.
    pub fn prefetch(&mut self) {
        let State::Ready(_) = self.state else {
            return;
        };
        let Some(pool) = mask_pool() else {
            return;
        };
        let State::Ready(mut matcher) = std::mem::replace(&mut self.state, State::Lost) else {
            unreachable!("matched Ready above")
        };
        let (tx, rx) = mpsc::channel();
        pool.spawn(move || {
            let result = matcher.compute_mask();
            let _ = tx.send((matcher, result));
        });
        self.state = State::Computing(rx);
    }

    fn matcher(&mut self) -> Result<&mut GrammarMatcher, StructuredError> {
        if let State::Computing(rx) = &self.state {
            self.state = match rx.recv() {
                // A failed computation is redone (and reported) by the caller's next call.
                Ok((matcher, _)) => State::Ready(matcher),
                Err(_) => State::Lost,
            };
        }
        match &mut self.state {
            State::Ready(m) => Ok(m),
            _ => Err(StructuredError::Matcher(
                "the grammar matcher was lost to a crash".into(),
            )),
        }
    }

    /// See [`GrammarMatcher::apply_mask`].
    pub fn apply_mask(&mut self, logits: &mut [f32]) -> Result<(), StructuredError> {
        self.matcher()?.apply_mask(logits)
    }

    /// See [`GrammarMatcher::mask_words`]; waits for a mask under way.
    pub fn mask_words(&mut self) -> Result<Vec<u32>, StructuredError> {
        self.matcher()?.mask_words()
    }

    /// See [`GrammarMatcher::accept`].
    pub fn accept(&mut self, token: u32) -> Result<Progress, StructuredError> {
        self.matcher()?.accept(token)
    }

    /// See [`GrammarMatcher::valid_prefix`]; 0 when the matcher was lost. Waits for a mask
    /// under way, which the next sample needs anyway.
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        self.matcher().map_or(0, |m| m.valid_prefix(tokens))
    }

    /// Whether the output so far is a complete match. (Each completion of a prompt gets its own
    /// `Constraint` from the compiled grammar: see `CompiledGrammar::matcher`.)
    pub fn is_accepting(&mut self) -> bool {
        self.matcher().map(|m| m.is_accepting()).unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_clears_forbidden_ids_and_everything_past_the_mask() {
        let mut logits = vec![1.0f32; 70];
        // ids 0 and 33 allowed; the mask covers 64 ids.
        mask_logits(&[0b1, 0b10], &mut logits);
        let allowed: Vec<usize> = logits
            .iter()
            .enumerate()
            .filter(|(_, x)| x.is_finite())
            .map(|(i, _)| i)
            .collect();
        assert_eq!(allowed, vec![0, 33]);
        let mut logits = vec![1.0f32; 40];
        mask_logits(&[u32::MAX, u32::MAX], &mut logits);
        assert!(logits.iter().all(|x| x.is_finite()));
    }
}
