//! Shared by the engine's unit tests.

use novainfer_model::Qwen2Config;

/// The shape of a toy backend that computes no real model: one layer, one head, width 8,
/// `vocab_size` tokens and `max_positions` positions. Only what the engine reads of it matters.
pub(crate) fn toy_config(vocab_size: usize, max_positions: usize) -> Qwen2Config {
    Qwen2Config {
        vocab_size,
        hidden_size: 8,
        intermediate_size: 8,
        num_hidden_layers: 1,
        num_attention_heads: 1,
        num_key_value_heads: 1,
        max_position_embeddings: max_positions,
        rope_theta: 1e4,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: false,
        torch_dtype: None,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

/// The parts of `Executor` a test backend over one block of one slot never varies: the CPU,
/// `self.config`, one block of one token of one byte, the CPU's capabilities. Expanded inside an
/// `impl Executor` block.
macro_rules! one_block_cpu_executor {
    () => {
        fn device(&self) -> novainfer_model::Device {
            novainfer_model::Device::Cpu
        }
        fn config(&self) -> &novainfer_model::Qwen2Config {
            &self.config
        }
        fn block_size(&self) -> usize {
            1
        }
        fn num_blocks(&self) -> usize {
            1
        }
        fn kv_bytes_per_block(&self) -> usize {
            1
        }
        fn capabilities(&self) -> novainfer_model::Capabilities {
            novainfer_model::capabilities::CPU
        }
    };
}
pub(crate) use one_block_cpu_executor;
