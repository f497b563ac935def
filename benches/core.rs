//! Core benchmarks: `cargo bench --bench core` (no Python needed).
//!
//! - hash_128k: the sha256_cbor / xxhash_cbor chains over a 128K-token request (H=16, 8192
//!   blocks), in MB/s of the CBOR bytes they hash, next to raw SHA-256 / XXH3-128 over the very
//!   same per-block CBOR buffers (built once, checked against the chain), one message per block,
//!   and over their concatenation as one stream.
//! - stride, tail, lookup, save: the planner on a 4-group hybrid
//!   FA 64 + SWA 64 (window 128) + mamba 256 (align) + circular_buffer 4, H=64, S=256.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvstride::cbor;
use kvstride::keys::{stride_indices, stride_keys};
use kvstride::{
    BlockHash, BlockHasher, GroupKind, GroupSpec, HashAlgo, KeyPlanner, MambaMode, NamespaceSpec,
    PlannerConfig,
};
use sha2::{Digest, Sha256};
use std::time::Duration;

const TOKENS: usize = 128 * 1024;
const HASH_H: usize = 16;
const PLAN_H: u64 = 64;

/// Token ids spread over a 152K vocabulary (xorshift), as a tokenizer hands them out.
fn tokens(n: usize) -> Vec<u32> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 152_064) as u32
        })
        .collect()
}

/// The exact CBOR input of each block of the chain: `[parent, tokens, null]`.
fn cbor_buffers(tokens: &[u32], h: usize, none_hash: &[u8], chain: &[BlockHash]) -> Vec<Vec<u8>> {
    tokens
        .chunks_exact(h)
        .enumerate()
        .map(|(i, block)| {
            let parent: &[u8] = if i == 0 {
                none_hash
            } else {
                chain[i - 1].as_ref()
            };
            let mut buf = Vec::with_capacity(48 + h * 5);
            buf.push(0x83);
            cbor::write_bytes(&mut buf, parent);
            cbor::write_head(&mut buf, 4, h as u64);
            for &t in block {
                cbor::write_head(&mut buf, 0, t as u64);
            }
            buf.push(0xf6);
            buf
        })
        .collect()
}

fn hashing(c: &mut Criterion) {
    let toks = tokens(TOKENS);
    let mut group = c.benchmark_group("hash_128k");
    group
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    for algo in [HashAlgo::Sha256Cbor, HashAlgo::XxhashCbor] {
        let hasher = BlockHasher::new(algo, Some("0")).unwrap();
        let chain = hasher.hash_blocks(&toks, HASH_H, None, None).unwrap();
        let buffers = cbor_buffers(&toks, HASH_H, hasher.none_hash(), &chain);
        for (buf, h) in buffers.iter().zip(&chain) {
            assert_eq!(
                algo.digest(buf).as_ref(),
                h.as_ref(),
                "buffers match the chain"
            );
        }
        let bytes: usize = buffers.iter().map(Vec::len).sum();
        eprintln!(
            "hash_128k/{}: {} blocks, {} CBOR bytes ({:.1} per block)",
            algo.name(),
            buffers.len(),
            bytes,
            bytes as f64 / buffers.len() as f64
        );
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(BenchmarkId::new("chain", algo.name()), |b| {
            b.iter(|| {
                hasher
                    .hash_blocks(black_box(&toks), HASH_H, None, None)
                    .unwrap()
            })
        });
        match algo {
            HashAlgo::Sha256Cbor => {
                // The same bytes as one stream (fewer compressions: no per-message padding).
                let joined = buffers.concat();
                group.bench_function("raw/sha256_one_stream", |b| {
                    b.iter(|| <[u8; 32]>::from(Sha256::digest(black_box(&joined))))
                });
                group.bench_function("raw/sha256", |b| {
                    b.iter(|| {
                        let mut last = [0u8; 32];
                        for buf in black_box(&buffers) {
                            last = Sha256::digest(buf).into();
                        }
                        last
                    })
                })
            }
            HashAlgo::XxhashCbor => group.bench_function("raw/xxh3_128", |b| {
                b.iter(|| {
                    let mut last = 0u128;
                    for buf in black_box(&buffers) {
                        last = xxhash_rust::xxh3::xxh3_128(buf);
                    }
                    last
                })
            }),
        };
    }
    group.finish();
}

fn hybrid() -> KeyPlanner {
    let groups = vec![
        GroupSpec::full_attention(64),
        GroupSpec::of_kind(GroupKind::SlidingWindow, 64, Some(128)).unwrap(),
        GroupSpec::mamba(256, MambaMode::Align),
        GroupSpec::of_kind(GroupKind::CircularBuffer, 4, None).unwrap(),
    ];
    let (s, h) = kvstride::resolve_block_sizes(&groups, Some(PLAN_H), 1).unwrap();
    assert_eq!((s, h), (256, PLAN_H));
    KeyPlanner::new(PlannerConfig {
        groups,
        hash_block_size: h,
        scheduler_block_size: s,
        namespace: NamespaceSpec::Fixed(
            "Qwen/Qwen3-Next-80B-A3B@tp_rank:0@pcp0@dcp0@pp_rank:0".into(),
        ),
        partial_hits: None,
        dcp: 1,
        tp_size: 1,
        tp_rank: 0,
    })
    .unwrap()
}

fn plan_hashes(tokens_n: usize) -> Vec<BlockHash> {
    let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    hasher
        .hash_blocks(&tokens(tokens_n), PLAN_H as usize, None, None)
        .unwrap()
}

fn tables(p: &KeyPlanner, tokens_n: u64) -> Vec<Vec<u64>> {
    p.groups()
        .iter()
        .enumerate()
        .map(|(g, spec)| {
            (0..tokens_n.div_ceil(spec.block_size))
                .map(|b| 1 + g as u64 * 1_000_000 + b)
                .collect()
        })
        .collect()
}

fn striding(c: &mut Criterion) {
    let toks = tokens(TOKENS);
    let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    let hashes = hasher.hash_blocks(&toks, HASH_H, None, None).unwrap();
    let mut group = c.benchmark_group("stride_128k");
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    group.throughput(Throughput::Elements(hashes.len() as u64));
    for k in [1usize, 4, 16] {
        group.bench_with_input(BenchmarkId::new("stride_keys", k), &k, |b, &k| {
            b.iter(|| stride_keys(black_box(&hashes), k, 0))
        });
    }
    // The incremental call of a decode step: one new chunk past 8191 derived.
    group.bench_function("stride_indices/incremental", |b| {
        b.iter(|| stride_indices(black_box(hashes.len()), 4, hashes.len() / 4 - 1))
    });
    group.finish();
}

fn tail(c: &mut Criterion) {
    let p = hybrid();
    let hashes = plan_hashes(TOKENS);
    let tokens_n = TOKENS as u64;
    let t = tables(&p, tokens_n);
    let boundary = tokens_n - PLAN_H; // a partial-tail boundary inside the last mamba block
    let handoffs = [(2usize, 4242u64, boundary)];
    let mut group = c.benchmark_group("tail_128k");
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    for (name, offset) in [("offset_0", 0u64), ("offset_last_S", boundary / 256 * 256)] {
        let plan = p
            .plan_tail(&hashes, &t, &handoffs, offset, &|_| false)
            .unwrap();
        eprintln!("tail_128k/{name}: {} puts", plan.puts.len());
        group.throughput(Throughput::Elements(plan.puts.len() as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                p.plan_tail(black_box(&hashes), &t, &handoffs, offset, &|_| false)
                    .unwrap()
            })
        });
    }
    group.finish();
}

fn lookup(c: &mut Criterion) {
    let p = hybrid();
    // The request length whose lookup consults ~8K (group, hash) candidates.
    let pool = plan_hashes(1 << 20);
    let mut n = 0u64;
    while p.lookup_candidates(&pool[..(n / PLAN_H) as usize], n).len() < 8192 {
        n += PLAN_H;
    }
    let hashes = plan_hashes(n as usize);
    let candidates = p.lookup_candidates(&hashes, n).len();
    eprintln!(
        "lookup_8k: {n} tokens, {} hashes, {candidates} candidates",
        hashes.len()
    );
    let keys = p.lookup_keys(&hashes, n);
    let all = vec![true; keys.len()];
    // The first 60% of every group's candidates present: a partial hit.
    let cutoff = (hashes.len() * 6 / 10) as u64 * PLAN_H;
    let partial: Vec<bool> = {
        let cands = p.lookup_candidates(&hashes, n);
        cands
            .iter()
            .map(|c| (c.hash_index as u64 + 1) * PLAN_H <= cutoff)
            .collect()
    };
    let none = vec![false; keys.len()];
    let mut group = c.benchmark_group("lookup_8k");
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    group.throughput(Throughput::Elements(candidates as u64));
    group.bench_function("lookup_candidates", |b| {
        b.iter(|| p.lookup_candidates(black_box(&hashes), n))
    });
    group.bench_function("lookup_keys", |b| {
        b.iter(|| p.lookup_keys(black_box(&hashes), n))
    });
    for (name, bits) in [
        ("all_present", &all),
        ("60pct_present", &partial),
        ("none_present", &none),
    ] {
        let hit = p.longest_hit_bitmap(&hashes, n, bits).unwrap();
        eprintln!("lookup_8k/longest_hit_bitmap/{name}: hit {hit}");
        group.bench_function(BenchmarkId::new("longest_hit_bitmap", name), |b| {
            b.iter(|| p.longest_hit_bitmap(black_box(&hashes), n, bits).unwrap())
        });
    }
    group.bench_function("keys_plus_bitmap/60pct_present", |b| {
        b.iter(|| {
            let keys = p.lookup_keys(black_box(&hashes), n);
            p.longest_hit_bitmap(&hashes, n, &partial[..keys.len()])
                .unwrap()
        })
    });
    group.finish();
}

fn save(c: &mut Criterion) {
    let p = hybrid();
    let hashes = plan_hashes(TOKENS);
    let tokens_n = TOKENS as u64;
    let t = tables(&p, tokens_n);
    let mut group = c.benchmark_group("save_128k");
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    for (name, offset) in [
        ("prefill_offset_0", 0u64),
        ("step_offset_end_minus_S", tokens_n - 256),
    ] {
        let plan = p
            .plan_save(&hashes, &t, tokens_n, offset, &|_| false)
            .unwrap();
        eprintln!(
            "save_128k/{name}: end {} with {} puts",
            plan.end,
            plan.puts.len()
        );
        group.throughput(Throughput::Elements(plan.puts.len() as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                p.plan_save(black_box(&hashes), &t, tokens_n, offset, &|_| false)
                    .unwrap()
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).without_plots();
    targets = hashing, striding, tail, lookup, save
}
criterion_main!(benches);
