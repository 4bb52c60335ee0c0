//! Block pool and prefix-cache throughput: allocate/free, hits, evicting churn.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use novainfer_core::{BlockKey, BlockPool, KvCacheManager, Request, RequestId};

const BLOCKS_PER_OP: usize = 64;

fn bench_pool(c: &mut Criterion) {
    let mut group = c.benchmark_group("block_pool");
    group.throughput(Throughput::Elements(BLOCKS_PER_OP as u64));

    let mut pool = BlockPool::new(4096);
    group.bench_function("allocate+free 64", |b| {
        b.iter(|| {
            let blocks = pool.allocate(BLOCKS_PER_OP).expect("room");
            pool.free(black_box(blocks).into_iter().rev());
        })
    });

    // Every free block is cached, so each allocation evicts a hash.
    let mut pool = BlockPool::new(1024);
    let mut next_token = 0u32;
    group.bench_function("allocate(evict)+cache+free 64", |b| {
        b.iter(|| {
            let blocks = pool.allocate(BLOCKS_PER_OP).expect("room");
            for &blk in &blocks {
                let tokens = [next_token; 16];
                next_token = next_token.wrapping_add(1);
                let key = BlockKey {
                    parent: None,
                    token_ids: &tokens,
                    extra_keys: &[],
                };
                pool.cache(blk, key.hash(), &key);
            }
            pool.free(blocks.into_iter().rev());
        })
    });

    // A 64-block prompt fully cached: lookup (hash + verify 64 blocks), take refs, release.
    let block_size = 16;
    let mut kv = KvCacheManager::new(4096, block_size, true);
    let prompt: Vec<u32> = (0..(BLOCKS_PER_OP * block_size) as u32 + 1).collect();
    let mut first = Request::new(RequestId(0), prompt.clone(), 1);
    kv.allocate_slots(&first, prompt.len(), &Default::default())
        .expect("room");
    first.num_computed_tokens = prompt.len();
    kv.cache_full_blocks(&first);
    kv.free(first.id);
    let second = Request::new(RequestId(1), prompt, 1);
    group.bench_function("prefix hit 64 blocks (lookup+allocate+free)", |b| {
        b.iter(|| {
            let hit = kv.lookup_prefix(&second);
            assert_eq!(hit.blocks.len(), BLOCKS_PER_OP);
            kv.allocate_slots(&second, 1, &hit).expect("room");
            kv.free(second.id);
        })
    });
    group.finish();
}

criterion_group!(benches, bench_pool);
criterion_main!(benches);
