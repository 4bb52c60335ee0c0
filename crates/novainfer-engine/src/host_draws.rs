//! Draws for a backend that samples nothing itself (the CPU): its logits rows are drawn right
//! after its forward, on the device thread, by the device kernel's host twin
//! ([`Draw::on_host`](novainfer_model::Draw::on_host)), so the engine sees a backend that draws.
//!
//! Async scheduling needs this: a step ahead takes the tokens of the step before it on the
//! device thread, without the engine thread sampling them first. A drawn token follows the
//! distribution the engine's sampler gives, from the device's counter-based generator; greedy
//! rows are the same tokens, seeded random ones a different (equally seeded) stream.

use novainfer_model::{
    Capabilities, Device, DeviceSampling, Executor, ForwardBatch, ForwardOutput, ModelError,
    Qwen2Config, SpanOutput,
};

pub struct HostDraws {
    inner: Box<dyn Executor>,
}

impl HostDraws {
    pub fn new(inner: Box<dyn Executor>) -> Self {
        Self { inner }
    }
}

impl Executor for HostDraws {
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn config(&self) -> &Qwen2Config {
        self.inner.config()
    }
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn kv_bytes_per_block(&self) -> usize {
        self.inner.kv_bytes_per_block()
    }
    fn weight_bytes_per_token(&self) -> Option<usize> {
        self.inner.weight_bytes_per_token()
    }
    fn weight_bytes(&self) -> Option<usize> {
        self.inner.weight_bytes()
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            sampling: DeviceSampling { draws: true },
            ..self.inner.capabilities()
        }
    }
    fn copy_block(
        &mut self,
        src: usize,
        dst: usize,
        num_tokens: usize,
    ) -> novainfer_model::Result<()> {
        self.inner.copy_block(src, dst, num_tokens)
    }

    fn forward(&mut self, batch: &ForwardBatch) -> novainfer_model::Result<ForwardOutput> {
        if !batch.has_draws() {
            return self.inner.forward(batch);
        }
        // The same pass with every drawn row asked for as logits, in the same places.
        let mut plain = batch.clone();
        for s in &mut plain.seqs {
            s.output = match &s.output {
                SpanOutput::Draw(_) => SpanOutput::LastLogits,
                SpanOutput::DrawEach(_) => SpanOutput::AllLogits,
                other => other.clone(),
            };
        }
        let got = self.inner.forward(&plain)?;
        let vocab = self.inner.config().vocab_size;
        let mut rows = got.logits.chunks_exact(vocab);
        let mut next_row = || {
            rows.next().ok_or_else(|| ModelError::Unsupported {
                what: "a forward that returned fewer logits rows than its spans ask for".into(),
                device: self.inner.device().to_string(),
            })
        };
        let mut out = ForwardOutput {
            hidden: got.hidden,
            ..ForwardOutput::default()
        };
        for s in &batch.seqs {
            match &s.output {
                SpanOutput::None | SpanOutput::LastHidden => {}
                SpanOutput::LastLogits if s.query_len > 0 => out.logits.extend(next_row()?),
                SpanOutput::LastLogits => {}
                SpanOutput::AllLogits => {
                    for _ in 0..s.query_len {
                        out.logits.extend(next_row()?);
                    }
                }
                SpanOutput::Draw(draw) if s.query_len > 0 => {
                    out.tokens.push(draw.on_host(next_row()?)?)
                }
                SpanOutput::Draw(_) => {}
                SpanOutput::DrawEach(each) => {
                    for draw in each.iter().take(s.query_len) {
                        out.tokens.push(draw.on_host(next_row()?)?);
                    }
                }
            }
        }
        Ok(out)
    }

    fn embed(&mut self, tokens: &[u32]) -> novainfer_model::Result<Vec<f32>> {
        self.inner.embed(tokens)
    }
    fn prompt_logits(
        &mut self,
        tokens: &[u32],
        step_by_step: bool,
    ) -> novainfer_model::Result<Vec<f32>> {
        self.inner.prompt_logits(tokens, step_by_step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use novainfer_model::Draw;

    const VOCAB: usize = 8;

    /// Row r of a forward has its maximum at id r % VOCAB, so a greedy draw returns r.
    struct Rows {
        config: Qwen2Config,
        asked: Vec<SpanOutput>,
    }

    impl Executor for Rows {
        crate::test_support::one_block_cpu_executor!();
        fn copy_block(&mut self, _: usize, _: usize, _: usize) -> novainfer_model::Result<()> {
            Ok(())
        }
        fn forward(&mut self, batch: &ForwardBatch) -> novainfer_model::Result<ForwardOutput> {
            assert!(
                !batch.has_draws(),
                "the wrapped backend is asked for logits only"
            );
            let mut out = ForwardOutput::default();
            let mut row = 0;
            for s in &batch.seqs {
                self.asked.push(s.output.clone());
                let n = match s.output {
                    SpanOutput::LastLogits => usize::from(s.query_len > 0),
                    SpanOutput::AllLogits => s.query_len,
                    SpanOutput::LastHidden => {
                        out.hidden.push(42.0);
                        0
                    }
                    _ => 0,
                };
                for _ in 0..n {
                    out.logits
                        .extend((0..VOCAB).map(|i| if i == row % VOCAB { 1.0 } else { 0.0 }));
                    row += 1;
                }
            }
            Ok(out)
        }
        fn embed(&mut self, _: &[u32]) -> novainfer_model::Result<Vec<f32>> {
            unreachable!()
        }
        fn prompt_logits(&mut self, _: &[u32], _: bool) -> novainfer_model::Result<Vec<f32>> {
            unreachable!()
        }
    }

    #[test]
    fn drawn_rows_are_drawn_in_place_and_the_rest_pass_through() {
        let config = crate::test_support::toy_config(VOCAB, 64);
        let mut host = HostDraws::new(Box::new(Rows {
            config,
            asked: Vec::new(),
        }));
        assert!(host.capabilities().sampling.draws);
        let greedy = Draw::greedy();
        let mut batch = ForwardBatch::default();
        let mut push = |tokens: &[u32], output: SpanOutput| {
            let start = batch.token_ids.len();
            let slots = (start..start + tokens.len()).collect();
            batch.push_span(tokens, start, slots, vec![0], output);
        };
        push(&[1], SpanOutput::LastLogits); // row 0
        push(&[2], SpanOutput::Draw(greedy.clone())); // row 1
        push(&[3, 4], SpanOutput::None);
        push(&[5, 6], SpanOutput::AllLogits); // rows 2, 3
        push(&[7, 8, 9], SpanOutput::DrawEach(vec![greedy.clone(); 3])); // rows 4, 5, 6
        push(&[10], SpanOutput::LastHidden);
        push(&[11], SpanOutput::Draw(greedy)); // row 7
        let out = host.forward(&batch).expect("runs");
        let tokens: Vec<u32> = out.tokens.iter().map(|t| t.token_id).collect();
        assert_eq!(tokens, vec![1, 4, 5, 6, 7]);
        // Logits rows 0, 2 and 3 come back, in order; the hidden row too.
        let argmax = |row: &[f32]| row.iter().position(|&x| x == 1.0);
        let rows: Vec<_> = out.logits.chunks(VOCAB).map(argmax).collect();
        assert_eq!(rows, vec![Some(0), Some(2), Some(3)]);
        assert_eq!(out.hidden, vec![42.0]);
    }
}
