//! Where one process sits in a tensor-parallel group: the interface reserved for
//! multi-GPU serving (docs/scaling.md). Only the single rank runs today; the engine
//! refuses a larger group at load time rather than silently serving on one GPU.
//!
//! The design it reserves: one process per GPU, rank 0 schedules and broadcasts each
//! step's batch, every rank holds `1 / world_size` of the attention heads and of the MLP's
//! intermediate columns (Megatron splits), and two all-reduces per layer (after the
//! attention output projection and after the MLP down projection) sum the partial results.

use novainfer_core::ParamError;

/// A rank in a tensor-parallel group of `world_size` processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorParallel {
    rank: usize,
    world_size: usize,
}

impl Default for TensorParallel {
    fn default() -> Self {
        Self::single()
    }
}

/// How one rank's share of the attention heads is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShard {
    /// Query heads this rank computes.
    pub num_heads: usize,
    /// KV heads this rank stores (a replica when there are fewer KV heads than ranks).
    pub num_kv_heads: usize,
    /// Ranks holding a copy of each KV head (1: no replication).
    pub kv_replicas: usize,
}

impl TensorParallel {
    /// One process, the whole model: what runs today.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
        }
    }

    pub fn new(rank: usize, world_size: usize) -> Result<Self, ParamError> {
        if world_size == 0 || rank >= world_size {
            return Err(ParamError::new(
                "tensor_parallel",
                format!("rank {rank} is not in a group of {world_size}"),
            ));
        }
        Ok(Self { rank, world_size })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Rank 0 runs the scheduler and talks to clients; the others only execute.
    pub fn is_driver(&self) -> bool {
        self.rank == 0
    }

    /// This rank's heads under a Megatron split: query heads divide evenly; KV heads
    /// divide evenly when there are at least as many as ranks, and are replicated
    /// (each on `world_size / num_kv_heads` ranks) when there are fewer, as vLLM does.
    pub fn shard_heads(
        &self,
        num_heads: usize,
        num_kv_heads: usize,
    ) -> Result<HeadShard, ParamError> {
        let w = self.world_size;
        let bad = |what: String| Err(ParamError::new("tensor_parallel", what));
        if num_kv_heads == 0 || !num_heads.is_multiple_of(w) {
            return bad(format!(
                "{num_heads} attention heads do not split over {w} ranks"
            ));
        }
        if num_kv_heads >= w {
            if !num_kv_heads.is_multiple_of(w) {
                return bad(format!(
                    "{num_kv_heads} KV heads do not split over {w} ranks"
                ));
            }
            Ok(HeadShard {
                num_heads: num_heads / w,
                num_kv_heads: num_kv_heads / w,
                kv_replicas: 1,
            })
        } else if w.is_multiple_of(num_kv_heads) {
            Ok(HeadShard {
                num_heads: num_heads / w,
                num_kv_heads: 1,
                kv_replicas: w / num_kv_heads,
            })
        } else {
            bad(format!(
                "{num_kv_heads} KV heads cannot be replicated evenly over {w} ranks"
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_must_lie_in_the_group() {
        assert!(TensorParallel::single().is_driver());
        assert_eq!(TensorParallel::new(1, 2).expect("valid").rank(), 1);
        assert!(TensorParallel::new(2, 2).is_err());
        assert!(TensorParallel::new(0, 0).is_err());
    }

    #[test]
    fn qwen2_head_counts_split_as_docs_scaling_says() {
        let tp = |w| TensorParallel::new(0, w).expect("valid");
        // 0.5B: 14 heads / 2 KV heads: TP 2 only (14 is not a multiple of 4).
        assert_eq!(
            tp(2).shard_heads(14, 2).expect("splits"),
            HeadShard {
                num_heads: 7,
                num_kv_heads: 1,
                kv_replicas: 1
            }
        );
        assert!(tp(4).shard_heads(14, 2).is_err());
        // 1.5B: 12 heads / 2 KV heads: TP 4 replicates each KV head on 2 ranks.
        assert_eq!(
            tp(4).shard_heads(12, 2).expect("splits"),
            HeadShard {
                num_heads: 3,
                num_kv_heads: 1,
                kv_replicas: 2
            }
        );
        assert!(tp(8).shard_heads(12, 2).is_err());
        // 7B: 28 heads / 4 KV heads: TP 2 and 4 split the KV heads.
        assert_eq!(tp(4).shard_heads(28, 4).expect("splits").num_kv_heads, 1);
        assert!(tp(8).shard_heads(28, 4).is_err());
    }
}
