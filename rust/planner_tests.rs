//! KeyPlanner against SEMANTICS §5 / §6 examples, and properties over random group mixes.
//! The lookup properties compare against an independent reading of §6 (`reference_hit`).

use crate::groups::{resolve_block_sizes, GroupKind, GroupSpec, MambaMode};
use crate::keys::stride_indices;
use crate::planner::{KeyPlanner, NamespaceSpec, PlannerConfig, TailOutcome, Transfer};
use proptest::prelude::*;
use std::collections::HashSet;

const NS: &str = "m@tp_rank:0@pcp0@dcp0@pp_rank:0";

fn planner(groups: Vec<GroupSpec>, h: u64, s: u64) -> KeyPlanner {
    KeyPlanner::new(PlannerConfig {
        groups,
        hash_block_size: h,
        scheduler_block_size: s,
        namespace: NamespaceSpec::Fixed(NS.into()),
        partial_hits: None,
        dcp: 1,
        tp_size: 1,
        tp_rank: 0,
    })
    .unwrap()
}

/// Distinct fake block hashes: `h[i]` is i as 8 big-endian bytes.
fn fake_hashes(n: usize) -> Vec<Vec<u8>> {
    (0..n as u64).map(|i| i.to_be_bytes().to_vec()).collect()
}

fn key(p: &KeyPlanner, g: usize, hashes: &[Vec<u8>], i: usize) -> String {
    p.key(g, &hashes[i])
}

fn never(_: &str) -> bool {
    false
}

fn set_of(puts: &[Transfer]) -> HashSet<String> {
    puts.iter().map(|t| t.key.clone()).collect()
}

fn assert_unique(puts: &[Transfer]) {
    let keys = set_of(puts);
    assert_eq!(keys.len(), puts.len(), "duplicate keys in {puts:?}");
}

// ---- §5 -----------------------------------------------------------------------------------

fn fa4_mamba16() -> KeyPlanner {
    let groups = vec![
        GroupSpec::full_attention(4),
        GroupSpec::mamba(16, MambaMode::Align),
    ];
    assert_eq!(resolve_block_sizes(&groups, None, 1), Ok((16, 4)));
    planner(groups, 4, 16)
}

/// §8: a 100-token prompt, alignment 16: its ends (96 for a resend and for a longer prompt),
/// every 32 tokens with a 32-token interval, and the deepest seen boundary (48).
#[test]
fn hit_boundaries_example() {
    let window = GroupSpec::of_kind(GroupKind::SlidingWindow, 16, Some(20)).unwrap();
    let p = planner(vec![GroupSpec::full_attention(16), window], 16, 16);
    assert_eq!(p.hit_boundaries(100, None, &[]), None);
    assert_eq!(p.hit_boundaries(100, Some(0), &[]), Some(vec![96]));
    assert_eq!(p.hit_boundaries(96, Some(0), &[]), Some(vec![80, 96]));
    assert_eq!(p.hit_boundaries(100, Some(32), &[]), Some(vec![32, 64, 96]));
    assert_eq!(p.hit_boundaries(100, Some(0), &[true, false, true, false]), Some(vec![48, 96]));
    assert_eq!(p.boundary_hash_indices(7, 100), vec![0, 1, 2, 3, 4, 5]);
    // Admitted at 48 and 96 only: the window's blocks 1-2 and 4-5 (a 20-token window needs
    // two 16-token blocks), not block 0 or 3.
    let hashes = fake_hashes(7);
    let tables = vec![(1..=7).collect::<Vec<u64>>(), (11..=17).collect::<Vec<u64>>()];
    let plan = p.plan_admitted_save_from(0, &hashes, &tables, 100, 0, Some(&[48, 96]), &never).unwrap();
    let window: Vec<u64> = plan.puts.iter().filter(|t| t.group == 1).map(|t| t.block_id).collect();
    assert_eq!(window, vec![12, 13, 15, 16]);
    assert!(p.plan_admitted_save_from(0, &hashes, &tables, 100, 0, Some(&[40]), &never).is_err());
}

#[test]
fn tail_example_from_offset_zero() {
    let p = fa4_mamba16();
    assert!(p.partial_hits());
    let h = fake_hashes(3);
    let tables = vec![vec![1, 2, 3], vec![4]];
    let plan = p.plan_tail(&h, &tables, &[(1, 7, 12)], 0, &never).unwrap();
    assert_eq!(plan.outcome, TailOutcome::Planned);
    assert_eq!(plan.boundary, Some(12));
    let got: Vec<(String, usize, u64)> = plan
        .puts
        .iter()
        .map(|t| (t.key.clone(), t.group, t.block_id))
        .collect();
    assert_eq!(
        got,
        vec![
            (key(&p, 0, &h, 0), 0, 1),
            (key(&p, 0, &h, 1), 0, 2),
            (key(&p, 0, &h, 2), 0, 3),
            (key(&p, 1, &h, 2), 1, 7),
        ]
    );
    assert_eq!(plan.puts[0].key, format!("{NS}@group:0@0000000000000000"));
}

#[test]
fn tail_example_from_saved_offset() {
    let p = fa4_mamba16();
    let h = fake_hashes(8);
    let tables = vec![(1..=8).collect(), vec![40, 41]];
    let plan = p.plan_tail(&h, &tables, &[(1, 9, 28)], 16, &never).unwrap();
    assert_eq!(plan.outcome, TailOutcome::Planned);
    let got: Vec<(String, u64)> = plan
        .puts
        .iter()
        .map(|t| (t.key.clone(), t.block_id))
        .collect();
    assert_eq!(
        got,
        vec![
            (key(&p, 0, &h, 4), 5),
            (key(&p, 0, &h, 5), 6),
            (key(&p, 0, &h, 6), 7),
            (key(&p, 1, &h, 6), 9),
        ]
    );
    // Once the store holds them, the same plan has nothing left to put.
    let held = set_of(&plan.puts);
    let again = p
        .plan_tail(&h, &tables, &[(1, 9, 28)], 16, &|k| held.contains(k))
        .unwrap();
    assert_eq!(again.outcome, TailOutcome::AllPresent);
    assert!(again.puts.is_empty());
}

#[test]
fn tail_outcomes() {
    let p = fa4_mamba16();
    let h = fake_hashes(3);
    let tables = vec![vec![1, 2, 3], vec![4]];
    let outcome = |hashes: &[Vec<u8>], handoffs: &[(usize, u64, u64)]| {
        p.plan_tail(hashes, &tables, handoffs, 0, &never).unwrap()
    };
    assert_eq!(outcome(&h, &[]).outcome, TailOutcome::None);
    assert_eq!(outcome(&[], &[(1, 7, 12)]).outcome, TailOutcome::None);
    // Not a multiple of the alignment H=4, or zero.
    assert_eq!(
        outcome(&h, &[(1, 7, 10)]).outcome,
        TailOutcome::InvalidBoundary
    );
    assert_eq!(
        outcome(&h, &[(1, 7, 0)]).outcome,
        TailOutcome::InvalidBoundary
    );
    let divergent = outcome(&h, &[(1, 7, 12), (0, 2, 8)]);
    assert_eq!(divergent.outcome, TailOutcome::DivergentBoundaries);
    assert!(divergent.puts.is_empty());
    let pending = outcome(&h, &[(1, 7, 16)]);
    assert_eq!(
        (pending.outcome, pending.boundary),
        (TailOutcome::HashPending, Some(16))
    );
    // A NULL hand-off and NULL attention blocks: no source at all.
    let empty = p
        .plan_tail(&h, &[vec![0, 0, 0], vec![4]], &[(1, 0, 12)], 0, &never)
        .unwrap();
    assert_eq!(empty.outcome, TailOutcome::None);
    // The last hand-off of a group wins.
    let last = outcome(&h, &[(1, 7, 12), (1, 8, 12)]);
    assert_eq!(last.puts.last().unwrap().block_id, 8);
    assert_eq!(last.puts.len(), 4);
}

#[test]
fn tail_skips_non_participating_groups() {
    let ring = GroupSpec::of_kind(GroupKind::CircularBuffer, 4, None).unwrap();
    let groups = vec![
        GroupSpec::full_attention(8),
        GroupSpec::mamba(16, MambaMode::Align),
        ring,
    ];
    let p = planner(groups, 8, 16);
    assert_eq!(p.hashes_per_block(), &[1, 2, 0]);
    let h = fake_hashes(2);
    let plan = p
        .plan_tail(
            &h,
            &[vec![1, 2], vec![3], vec![5, 6, 7, 8]],
            &[(1, 9, 16), (2, 4, 16)],
            0,
            &never,
        )
        .unwrap();
    assert!(plan.puts.iter().all(|t| t.group != 2), "{plan:?}");
    assert_eq!(plan.puts.len(), 3);
}

// ---- §6 -----------------------------------------------------------------------------------

#[test]
fn lookup_example_fa16_mamba16_h4() {
    let groups = vec![
        GroupSpec::full_attention(16),
        GroupSpec::mamba(16, MambaMode::Align),
    ];
    assert_eq!(resolve_block_sizes(&groups, Some(4), 1), Ok((16, 4)));
    let p = planner(groups, 4, 16);
    let h = fake_hashes(4);
    let store: HashSet<String> = [key(&p, 0, &h, 2), key(&p, 1, &h, 2)].into();
    let present = |k: &str| store.contains(k);
    assert_eq!(p.longest_hit(&h, 13, &present), 12);
    assert_eq!(p.longest_hit(&h, 12, &present), 0);
}

#[test]
fn lookup_example_fa32_mamba32_h16() {
    let groups = vec![
        GroupSpec::full_attention(32),
        GroupSpec::mamba(32, MambaMode::Align),
    ];
    let p = planner(groups, 16, 32);
    assert!(p.partial_hits());
    let h = fake_hashes(4);
    let mut store: HashSet<String> =
        [key(&p, 0, &h, 1), key(&p, 0, &h, 2), key(&p, 1, &h, 1)].into();
    assert_eq!(p.longest_hit(&h, 64, &|k| store.contains(k)), 32);
    store.insert(key(&p, 1, &h, 2));
    assert_eq!(p.longest_hit(&h, 64, &|k| store.contains(k)), 48);
    // The bitmap form agrees with the predicate form.
    let keys = p.lookup_keys(&h, 64);
    let bits: Vec<bool> = keys.iter().map(|k| store.contains(k)).collect();
    assert_eq!(p.longest_hit_bitmap(&h, 64, &bits).unwrap(), 48);
    assert!(p.longest_hit_bitmap(&h, 64, &bits[1..]).is_err());
}

#[test]
fn lookup_keys_cover_every_tp_namespace() {
    use crate::keys::Namespace;
    let mla = GroupSpec::of_kind(GroupKind::Mla, 16, None).unwrap();
    let mut fa = GroupSpec::full_attention(16);
    fa.num_kv_heads = Some(1);
    let p = KeyPlanner::new(PlannerConfig {
        groups: vec![fa, mla],
        hash_block_size: 16,
        scheduler_block_size: 16,
        namespace: NamespaceSpec::Parts(Namespace::new("m")),
        partial_hits: None,
        dcp: 1,
        tp_size: 2,
        tp_rank: 1,
    })
    .unwrap();
    // FA: one head on 2 ranks → replicated twice, key rank 0; MLA: replicated on both.
    assert_eq!(p.replication(0), 2);
    assert_eq!(p.namespaces_per_group(0), 1);
    assert_eq!(p.namespaces_per_group(1), 1);
    let h = fake_hashes(2);
    let keys = p.lookup_keys(&h, 32);
    assert_eq!(keys.len(), 4);
    assert!(
        keys.iter().all(|k| k.starts_with("m@tp_rank:0@")),
        "{keys:?}"
    );
}

#[test]
fn namespace_tp_rank_must_agree_with_the_planner() {
    use crate::keys::Namespace;
    let config = |ns_rank: Option<u64>, tp_rank: u64| PlannerConfig {
        groups: vec![GroupSpec::full_attention(16)],
        hash_block_size: 16,
        scheduler_block_size: 16,
        namespace: NamespaceSpec::Parts(Namespace {
            tp_rank: ns_rank,
            ..Namespace::new("m")
        }),
        partial_hits: None,
        dcp: 1,
        tp_size: 2,
        tp_rank,
    };
    // A rank-1 Namespace under a rank-0 planner would key rank 1's shard as rank 0's.
    let err = KeyPlanner::new(config(Some(1), 0)).unwrap_err().0;
    assert!(
        err.contains("tp_rank=0") && err.contains("tp_rank=1"),
        "{err}"
    );
    let h = fake_hashes(1);
    for ns_rank in [Some(1), None] {
        let p = KeyPlanner::new(config(ns_rank, 1)).unwrap();
        assert!(
            p.key(0, &h[0]).starts_with("m@tp_rank:1@"),
            "{}",
            p.key(0, &h[0])
        );
    }
}

#[test]
fn saved_offset_after_load_is_the_last_scheduler_block_loaded() {
    let p = planner(
        vec![
            GroupSpec::full_attention(16),
            GroupSpec::mamba(64, MambaMode::Align),
        ],
        16,
        64,
    );
    assert_eq!(p.alignment(), 16);
    assert_eq!(p.saved_offset_after_load(0), 0);
    assert_eq!(p.saved_offset_after_load(48), 0);
    assert_eq!(p.saved_offset_after_load(64), 64);
    assert_eq!(p.saved_offset_after_load(112), 64);
}

// ---- random mixes ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Mix {
    groups: Vec<GroupSpec>,
    h: u64,
    s: u64,
}

/// (kind 0..6, size multiple 1..=4, window, ring size)
type RawGroup = (u8, u64, u64, u64);

fn build_mix(h: u64, raw: &[RawGroup], with_mamba: Option<bool>) -> Mix {
    let mut groups: Vec<GroupSpec> = raw
        .iter()
        .map(|&(kind, mult, window, ring)| {
            let size = h * mult;
            match kind {
                0 => GroupSpec::full_attention(size),
                1 => GroupSpec::of_kind(GroupKind::Mla, size, None).unwrap(),
                2 => GroupSpec::of_kind(GroupKind::SlidingWindow, size, Some(window)).unwrap(),
                3 => GroupSpec::of_kind(GroupKind::ChunkedLocal, size, Some(window)).unwrap(),
                4 => GroupSpec::mamba(size, MambaMode::Align),
                _ => GroupSpec::of_kind(GroupKind::CircularBuffer, ring, None).unwrap(),
            }
        })
        .collect();
    match with_mamba {
        Some(false) => {
            for g in groups.iter_mut().filter(|g| g.kind == GroupKind::Mamba) {
                *g = GroupSpec::full_attention(g.block_size);
            }
        }
        Some(true) if !groups.iter().any(|g| g.kind == GroupKind::Mamba) => {
            let mult = raw[0].1;
            groups.push(GroupSpec::mamba(h * mult, MambaMode::Align));
        }
        _ => {}
    }
    if !groups.iter().any(|g| g.prefix_cacheable) {
        groups[0] = GroupSpec::full_attention(h);
    }
    let unit = (groups.len() > 1).then_some(h);
    let (s, h) = resolve_block_sizes(&groups, unit, 1).unwrap();
    Mix { groups, h, s }
}

fn raw_groups() -> impl Strategy<Value = Vec<RawGroup>> {
    prop::collection::vec(
        (
            0u8..6,
            1u64..=4,
            1u64..=48,
            prop::sample::select(vec![1u64, 2, 3, 4, 8]),
        ),
        1..=4,
    )
}

fn hash_unit() -> impl Strategy<Value = u64> {
    prop::sample::select(vec![1u64, 2, 4, 8, 16])
}

/// Block tables long enough for every hash, with distinct non-NULL ids.
fn full_tables(p: &KeyPlanner, num_hashes: usize) -> Vec<Vec<u64>> {
    let tokens = num_hashes as u64 * p.hash_block_size();
    p.groups()
        .iter()
        .enumerate()
        .map(|(g, spec)| {
            let blocks = tokens.div_ceil(spec.block_size) + 1;
            (0..blocks).map(|b| 1 + g as u64 * 100_000 + b).collect()
        })
        .collect()
}

/// SEMANTICS §6 read directly: can group `g` serve `x` tokens from the keys in `store`?
fn group_serves(
    p: &KeyPlanner,
    hashes: &[Vec<u8>],
    store: &HashSet<String>,
    g: usize,
    x: u64,
) -> bool {
    let h = p.hash_block_size();
    if x == 0 {
        return true;
    }
    if x % p.alignment() != 0 || x / h > hashes.len() as u64 {
        return false;
    }
    let has = |tokens: u64| store.contains(&key(p, g, hashes, (tokens / h - 1) as usize));
    let spec = &p.groups()[g];
    let b = spec.block_size;
    match spec.kind {
        GroupKind::Mamba => has(x),
        GroupKind::FullAttention | GroupKind::Mla => {
            (1..=x / b).all(|blocks| has(blocks * b)) && (x % b == 0 || has(x))
        }
        GroupKind::SlidingWindow | GroupKind::ChunkedLocal => {
            let w = spec.window.unwrap();
            let lo = if spec.kind == GroupKind::SlidingWindow {
                (x + 1).saturating_sub(w)
            } else {
                x / w * w
            };
            if lo >= x {
                return true;
            }
            (lo / b..x.div_ceil(b)).all(|blk| has(((blk + 1) * b).min(x)))
        }
        GroupKind::CircularBuffer => unreachable!("rings never participate in these mixes"),
    }
}

fn all_serve(p: &KeyPlanner, hashes: &[Vec<u8>], store: &HashSet<String>, x: u64) -> bool {
    (0..p.groups().len())
        .filter(|&g| p.hashes_per_block()[g] > 0)
        .all(|g| group_serves(p, hashes, store, g, x))
}

fn reference_hit(p: &KeyPlanner, hashes: &[Vec<u8>], store: &HashSet<String>, n: u64) -> u64 {
    let a = p.alignment();
    let best = |t: u64| {
        (0..=t / a)
            .rev()
            .map(|i| i * a)
            .find(|&x| all_serve(p, hashes, store, x))
            .unwrap()
    };
    let t = n.min(hashes.len() as u64 * p.hash_block_size()) / a * a;
    let hit = best(t);
    if hit > 0 && hit >= n {
        best((n - 1) / a * a)
    } else {
        hit
    }
}

/// A pseudo-random subset of `keys` (splitmix64 of a seed), about `density`/8 of them.
fn subset(keys: &[String], seed: u64, density: u64) -> HashSet<String> {
    let mut state = seed;
    keys.iter()
        .filter(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) % 8 < density
        })
        .cloned()
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// (a) stride_indices per group is incremental and stays inside the hashes.
    #[test]
    fn stride_is_incremental(
        h in hash_unit(),
        raw in raw_groups(),
        blocks_per_chunk in 1u64..=3,
        n1 in 0usize..200,
        extra in 0usize..200,
    ) {
        let mix = build_mix(h, &raw, None);
        let p = planner(mix.groups.clone(), mix.h, mix.s);
        let n2 = n1 + extra;
        for &per_block in p.hashes_per_block() {
            let k = (per_block * blocks_per_chunk) as usize;
            let first = stride_indices(n1, k, 0);
            prop_assert!(first.iter().all(|&i| i < n1));
            for (j, &i) in first.iter().enumerate() {
                prop_assert_eq!(i, (j + 1) * k - 1, "chunk {} is keyed by its last hash", j);
            }
            prop_assert!(stride_indices(n1, k, first.len()).is_empty(), "no new hashes → nothing");
            let more = stride_indices(n2, k, first.len());
            prop_assert!(more.iter().all(|&i| i < n2));
            let mut joined = first.clone();
            joined.extend(&more);
            prop_assert_eq!(&joined, &stride_indices(n2, k, 0), "a second call only appends");
            if k == 0 {
                prop_assert!(joined.is_empty());
            } else {
                prop_assert_eq!(joined.len(), n2 / k);
            }
        }
    }

    /// (b) + (d): after a tail plan's puts exist, the boundary is served at boundary + 1.
    #[test]
    fn tail_puts_serve_the_boundary(
        h in hash_unit(),
        raw in raw_groups(),
        pick in any::<u64>(),
        more_hashes in 0usize..8,
        seed in any::<u64>(),
        density in 0u64..=4,
    ) {
        let mix = build_mix(h, &raw, Some(true));
        let p = planner(mix.groups.clone(), mix.h, mix.s);
        let a = p.alignment();
        let steps = 1 + pick % 12;
        let boundary = a * steps;
        let num_hashes = (boundary / p.hash_block_size()) as usize + more_hashes;
        let hashes = fake_hashes(num_hashes);
        let tables = full_tables(&p, num_hashes);
        let handoffs: Vec<(usize, u64, u64)> = (0..p.groups().len())
            .filter(|&g| p.groups()[g].kind == GroupKind::Mamba && p.hashes_per_block()[g] > 0)
            .map(|g| (g, 900_000 + g as u64, boundary))
            .collect();
        // Some keys may already be in the store (they are filtered out of the plan).
        let already = subset(&p.lookup_keys(&hashes, boundary), seed, density);
        let plan = p.plan_tail(&hashes, &tables, &handoffs, 0, &|k| already.contains(k)).unwrap();
        prop_assert!(matches!(plan.outcome, TailOutcome::Planned | TailOutcome::AllPresent), "{:?}", plan);
        assert_unique(&plan.puts);
        prop_assert!(plan.puts.iter().all(|t| !already.contains(&t.key)));
        let mut store = already.clone();
        store.extend(set_of(&plan.puts));
        let hit = p.longest_hit(&hashes, boundary + 1, &|k| store.contains(k));
        prop_assert_eq!(hit, boundary, "{:?}", mix);
        // With only the tail's own keys (nothing held before), the same holds.
        let all = p.plan_tail(&hashes, &tables, &handoffs, 0, &never).unwrap();
        assert_unique(&all.puts);
        let own = set_of(&all.puts);
        prop_assert_eq!(p.longest_hit(&hashes, boundary + 1, &|k| own.contains(k)), boundary);
    }

    /// (c) + (d): the hit is what every group alone can serve (and the largest such length);
    /// the load plan for it has unique keys, all of them present.
    #[test]
    fn longest_hit_matches_reference(
        h in hash_unit(),
        raw in raw_groups(),
        num_hashes in 0usize..40,
        n_extra in 0u64..40,
        seed in any::<u64>(),
        density in 0u64..=8,
        local_pick in any::<u64>(),
    ) {
        let mix = build_mix(h, &raw, None);
        let p = planner(mix.groups.clone(), mix.h, mix.s);
        let hashes = fake_hashes(num_hashes);
        let n = (num_hashes as u64 * p.hash_block_size()).saturating_sub(n_extra) + n_extra / 2;
        let store = subset(&p.lookup_keys(&hashes, n), seed, density);
        let hit = p.longest_hit(&hashes, n, &|k| store.contains(k));
        prop_assert_eq!(hit, reference_hit(&p, &hashes, &store, n), "{:?} n={}", mix, n);
        prop_assert!(hit == 0 || hit < n);
        for g in (0..p.groups().len()).filter(|&g| p.hashes_per_block()[g] > 0) {
            prop_assert!(group_serves(&p, &hashes, &store, g, hit), "group {} cannot serve {}", g, hit);
        }
        let keys = p.lookup_keys(&hashes, n);
        prop_assert_eq!(keys.iter().collect::<HashSet<_>>().len(), keys.len(), "duplicate lookup keys");
        let local = if hit == 0 { 0 } else { local_pick % (hit + 1) };
        let load = p.plan_load(&hashes, &full_tables(&p, num_hashes), hit, local).unwrap();
        assert_unique(&load.gets);
        prop_assert!(load.missing.is_empty());
        prop_assert!(load.gets.iter().all(|t| store.contains(&t.key)), "a get outside the store");
        // The boundary set's size per group is what a load from nothing reads.
        let from_nothing = p.plan_load(&hashes, &full_tables(&p, num_hashes), hit, 0).unwrap();
        let mut per_group = vec![0u64; p.groups().len()];
        for t in &from_nothing.gets {
            per_group[t.group] += 1;
        }
        prop_assert_eq!(p.hit_set_blocks(hit), per_group);
    }

    /// A save planned from the inputs' tail (`plan_save_from` at any base up to `save_base`)
    /// is the save planned from the whole inputs.
    #[test]
    fn plan_save_from_a_base_is_plan_save(
        h in hash_unit(),
        raw in raw_groups(),
        num_hashes in 0usize..40,
        n_extra in 0u64..40,
        offset_pick in any::<u64>(),
        base_pick in any::<u64>(),
    ) {
        let mix = build_mix(h, &raw, None);
        let p = planner(mix.groups.clone(), mix.h, mix.s);
        let hashes = fake_hashes(num_hashes);
        let tables = full_tables(&p, num_hashes);
        let n = num_hashes as u64 * p.hash_block_size() + n_extra;
        let saved_offset = offset_pick % (n / mix.s + 1) * mix.s;
        let whole = p.plan_save(&hashes, &tables, n, saved_offset, &never).unwrap();
        let base = base_pick % (p.save_base(saved_offset) / mix.s + 1) * mix.s;
        let (first_hash, rows) = p.rows_at(base);
        let tail: Vec<Vec<u64>> = tables.iter().zip(&rows).map(|(t, &r)| t[r.min(t.len())..].to_vec()).collect();
        let from = p.plan_save_from(base, &hashes[first_hash.min(hashes.len())..], &tail, n, saved_offset, &never).unwrap();
        prop_assert_eq!(from.end, whole.end);
        prop_assert_eq!(from.puts, whole.puts, "{:?} saved_offset={} base={}", mix, saved_offset, base);
        prop_assert!(p.plan_save_from(p.save_base(saved_offset) + mix.s, &hashes, &tables, n, saved_offset, &never).is_err());
    }

    /// The Python binding sizes its key list with `lookup_key_count` and refuses a fill that
    /// disagrees with it: the count is the keys `for_each_candidate_key` emits, at any TP size.
    #[test]
    fn lookup_key_count_is_the_keys_emitted(
        h in hash_unit(),
        raw in raw_groups(),
        num_hashes in 0usize..40,
        n in 0u64..800,
        tp_size in prop::sample::select(vec![1u64, 2, 4]),
        heads in 1u64..=4,
    ) {
        let mix = build_mix(h, &raw, None);
        let mut groups = mix.groups.clone();
        for g in groups.iter_mut().filter(|g| g.kind == GroupKind::FullAttention) {
            g.num_kv_heads = Some(heads);
        }
        let p = KeyPlanner::new(PlannerConfig {
            groups,
            hash_block_size: mix.h,
            scheduler_block_size: mix.s,
            namespace: NamespaceSpec::Parts(crate::keys::Namespace::new("m")),
            partial_hits: None,
            dcp: 1,
            tp_size,
            tp_rank: tp_size - 1,
        })
        .unwrap();
        let hashes = fake_hashes(num_hashes);
        let candidates = p.lookup_candidates(&hashes, n);
        let mut emitted = 0;
        p.for_each_candidate_key(&hashes, &candidates, |_| emitted += 1);
        prop_assert_eq!(emitted, p.lookup_key_count(&candidates));
    }

    /// (d) + (e): without mamba, after a save's puts exist the save end is served.
    #[test]
    fn save_puts_serve_the_end(
        h in hash_unit(),
        raw in raw_groups(),
        num_hashes in 0usize..60,
        n_extra in 0u64..64,
    ) {
        let mix = build_mix(h, &raw, Some(false));
        let p = planner(mix.groups.clone(), mix.h, mix.s);
        let hashes = fake_hashes(num_hashes);
        let tables = full_tables(&p, num_hashes);
        let n = num_hashes as u64 * p.hash_block_size() + n_extra;
        let plan = p.plan_save(&hashes, &tables, n, 0, &never).unwrap();
        assert_unique(&plan.puts);
        prop_assert_eq!(plan.end % p.scheduler_block_size(), 0);
        prop_assert!(plan.end <= num_hashes as u64 * p.hash_block_size());
        let store = set_of(&plan.puts);
        let hit = p.longest_hit(&hashes, plan.end + 1, &|k| store.contains(k));
        prop_assert!(hit >= plan.end, "hit {} < save end {} for {:?}", hit, plan.end, mix);
        // A second save from the new offset with the same tokens puts nothing.
        let again = p.plan_save(&hashes, &tables, n, plan.end, &|k| store.contains(k)).unwrap();
        prop_assert!(again.puts.is_empty(), "{:?}", again);
        // Saving in two steps puts the same keys as one save.
        let mid = plan.end / p.scheduler_block_size() / 2 * p.scheduler_block_size();
        let first = p.plan_save(&hashes, &tables, mid, 0, &never).unwrap();
        let held = set_of(&first.puts);
        let second = p.plan_save(&hashes, &tables, n, first.end, &|k| held.contains(k)).unwrap();
        assert_unique(&second.puts);
        let mut stepped = held.clone();
        stepped.extend(set_of(&second.puts));
        prop_assert_eq!(
            p.longest_hit(&hashes, plan.end + 1, &|k| stepped.contains(k)),
            plan.end
        );
    }
}

#[test]
fn keyed_keys_differ_keep_shape_and_agree_between_lookup_and_plans() {
    let groups = vec![
        GroupSpec::full_attention(16),
        GroupSpec::mamba(16, MambaMode::Align),
    ];
    let plain = planner(groups.clone(), 4, 16);
    let keyed = planner(groups.clone(), 4, 16).with_secret(&[42u8; 32]).unwrap();
    let other = planner(groups, 4, 16).with_secret(&[43u8; 32]).unwrap();
    let hashes = fake_hashes(8);
    let (a, b, c) = (key(&plain, 0, &hashes, 3), key(&keyed, 0, &hashes, 3), key(&other, 0, &hashes, 3));
    assert_eq!(a, format!("{NS}@group:0@{}", crate::keys::hex(&hashes[3])));
    assert_ne!(a, b);
    assert_ne!(b, c);
    assert_eq!(a.len(), b.len(), "same length as the unkeyed key");
    assert!(b.starts_with(&format!("{NS}@group:0@")));
    assert_ne!(key(&keyed, 0, &hashes, 3)[NS.len() + 9..], key(&keyed, 1, &hashes, 3)[NS.len() + 9..]);
    let keys = keyed.lookup_keys(&hashes, 33);
    for k in &keys {
        let g: usize = k[NS.len() + 7..NS.len() + 8].parse().unwrap();
        assert!((0..8).any(|i| &key(&keyed, g, &hashes, i) == k), "{k}");
    }
    let present: HashSet<String> = (0..8).flat_map(|i| [key(&keyed, 0, &hashes, i), key(&keyed, 1, &hashes, i)]).collect();
    assert_eq!(keyed.longest_hit(&hashes, 33, &|k| present.contains(k)), 32);
    assert_eq!(plain.longest_hit(&hashes, 33, &|k| present.contains(k)), 0);
}

#[test]
fn save_base_for_falls_back_to_zero_when_the_hashes_stop_short() {
    let p = fa4_mamba16(); // H = 4, s = 16
    assert_eq!(p.save_base(64), 48);
    assert_eq!(p.rows_at(48).0, 12);
    assert_eq!(p.save_base_for(64, Some(12)), 48);
    assert_eq!(p.save_base_for(64, Some(40)), 48);
    assert_eq!(p.save_base_for(64, Some(11)), 0, "fewer hashes than the base: read whole");
    assert_eq!(p.save_base_for(64, None), 0, "unknown length: read whole");
    assert_eq!(p.save_base_for(0, Some(0)), 0);
}
