//! SEMANTICS §4–§7 for one rank: which keys a save, a partial tail or a load puts or gets,
//! and the longest prefix every group can serve from the store.

use crate::error::{Error, Result};
use crate::groups::{hashes_per_block, participating, GroupKind, GroupSpec, MambaMode};
use crate::secret::Secret;
use crate::keys::{push_hex, rank_puts_block, replication, Namespace};
use std::collections::HashSet;

pub const NULL_BLOCK: u64 = 0;

/// How a planner names its keys: a fixed namespace (one tp=1 rank), or namespace parts that
/// vary the key's TP rank per group.
#[derive(Clone, Debug)]
pub enum NamespaceSpec {
    Fixed(String),
    Parts(Namespace),
}

#[derive(Clone, Debug)]
pub struct PlannerConfig {
    pub groups: Vec<GroupSpec>,
    pub hash_block_size: u64,
    pub scheduler_block_size: u64,
    pub namespace: NamespaceSpec,
    pub partial_hits: Option<bool>,
    pub dcp: u64,
    pub tp_size: u64,
    /// This rank. A `NamespaceSpec::Parts` that names another TP rank is refused.
    pub tp_rank: u64,
}

/// One key to move and the block it moves from or to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub key: String,
    pub group: usize,
    pub block_id: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TailOutcome {
    None,
    InvalidBoundary,
    DivergentBoundaries,
    HashPending,
    AllPresent,
    Planned,
}

impl TailOutcome {
    pub fn name(self) -> &'static str {
        match self {
            TailOutcome::None => "none",
            TailOutcome::InvalidBoundary => "invalid_boundary",
            TailOutcome::DivergentBoundaries => "divergent_boundaries",
            TailOutcome::HashPending => "hash_pending",
            TailOutcome::AllPresent => "all_present",
            TailOutcome::Planned => "planned",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TailPlan {
    pub outcome: TailOutcome,
    pub boundary: Option<u64>,
    pub puts: Vec<Transfer>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavePlan {
    /// The saved offset once every put of the plan succeeded.
    pub end: u64,
    pub puts: Vec<Transfer>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadPlan {
    pub hit: u64,
    pub start: u64,
    pub gets: Vec<Transfer>,
    /// `(group, block index)` whose destination block is NULL or beyond the table.
    pub missing: Vec<(usize, u64)>,
}

/// A `(group, hash index)` pair the lookup may consult.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub group: usize,
    pub hash_index: usize,
}

#[derive(Clone, Debug)]
pub struct KeyPlanner {
    groups: Vec<GroupSpec>,
    h: u64,
    s: u64,
    dcp: u64,
    tp_rank: u64,
    partial_hits: bool,
    effective: Vec<u64>,
    per_block: Vec<u64>,
    replication: Vec<u64>,
    /// `"{namespace}@group:{g}@"` for this rank, per group.
    own_prefix: Vec<String>,
    /// The same for every key TP rank some rank loads, per group.
    lookup_prefixes: Vec<Vec<String>>,
    /// With a deployment secret, a key's hash part is keyed (SEMANTICS §3, "Keyed keys").
    secret: Option<std::sync::Arc<Secret>>,
}

fn cdiv(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

impl KeyPlanner {
    pub fn new(config: PlannerConfig) -> Result<Self> {
        let PlannerConfig {
            groups,
            hash_block_size: h,
            scheduler_block_size: s,
            namespace,
            partial_hits,
            dcp,
            tp_size,
            tp_rank,
        } = config;
        if groups.is_empty() {
            return Err(Error::new(
                "no KV-cache groups: pass at least one GroupSpec",
            ));
        }
        if h == 0 || s == 0 {
            return Err(Error::new(format!(
                "hash_block_size={h}, scheduler_block_size={s}: both must be positive \
                 (resolve_block_sizes gives a pair that works)"
            )));
        }
        if s % h != 0 {
            return Err(Error::new(format!(
                "scheduler_block_size={s} is not a multiple of hash_block_size={h} \
                 (resolve_block_sizes gives a pair that works)"
            )));
        }
        if tp_size == 0 || tp_rank >= tp_size {
            return Err(Error::new(format!(
                "tp_rank={tp_rank} with tp_size={tp_size}: need tp_size >= 1 and \
                 0 <= tp_rank < tp_size"
            )));
        }
        let per_block = hashes_per_block(&groups, h, dcp)?;
        let takes_part = participating(&groups);
        let effective: Vec<u64> = groups.iter().map(|g| g.effective_size(dcp)).collect();
        let not_dividing: Vec<String> = (0..groups.len())
            .filter(|&i| takes_part[i] && s % effective[i] != 0)
            .map(|i| groups[i].describe(i, dcp))
            .collect();
        if !not_dividing.is_empty() {
            return Err(Error::new(format!(
                "{} does not divide scheduler_block_size={s}: S must be a multiple of every \
                 prefix-cacheable block size (their lcm; resolve_block_sizes gives it)",
                not_dividing.join(", ")
            )));
        }
        let replication: Vec<u64> = groups
            .iter()
            .map(|g| replication(g, tp_size, dcp))
            .collect();
        let (own_prefix, lookup_prefixes) = match &namespace {
            NamespaceSpec::Fixed(text) => {
                if tp_size != 1 {
                    return Err(Error::new(format!(
                        "a fixed namespace string cannot carry per-group TP ranks \
                         (tp_size={tp_size}); pass a Namespace instead"
                    )));
                }
                let own: Vec<String> = (0..groups.len())
                    .map(|g| format!("{text}@group:{g}@"))
                    .collect();
                let all = own.iter().map(|p| vec![p.clone()]).collect();
                (own, all)
            }
            NamespaceSpec::Parts(ns) => {
                ns.validate()?;
                // A Namespace naming another TP rank than this planner's is refused.
                let ns = ns.with_ranks(Some(tp_rank), None)?;
                // Under DCP every rank keys its own shard, and rank t is dcp rank t % dcp.
                let text = |key_rank: u64| {
                    if dcp > 1 {
                        ns.text_with(key_rank, key_rank % dcp)
                    } else {
                        ns.text(key_rank)
                    }
                };
                let own = (0..groups.len())
                    .map(|g| format!("{}@group:{g}@", text(tp_rank / replication[g])))
                    .collect();
                let all = (0..groups.len())
                    .map(|g| {
                        (0..cdiv(tp_size, replication[g]))
                            .map(|rank| format!("{}@group:{g}@", text(rank)))
                            .collect()
                    })
                    .collect();
                (own, all)
            }
        };
        let partial_hits = partial_hits.unwrap_or_else(|| {
            groups.iter().any(|g| {
                g.kind == GroupKind::Mamba && g.mamba_mode == MambaMode::Align && g.block_size > h
            })
        });
        Ok(KeyPlanner {
            groups,
            h,
            s,
            dcp,
            tp_rank,
            partial_hits,
            effective,
            per_block,
            replication,
            own_prefix,
            lookup_prefixes,
            secret: None,
        })
    }

    pub fn groups(&self) -> &[GroupSpec] {
        &self.groups
    }
    pub fn hash_block_size(&self) -> u64 {
        self.h
    }
    pub fn scheduler_block_size(&self) -> u64 {
        self.s
    }
    pub fn dcp(&self) -> u64 {
        self.dcp
    }
    pub fn partial_hits(&self) -> bool {
        self.partial_hits
    }
    pub fn hashes_per_block(&self) -> &[u64] {
        &self.per_block
    }
    pub fn replication(&self, group: usize) -> u64 {
        self.replication[group]
    }
    /// Lookups and tail boundaries land on multiples of this: H with partial hits, else S.
    pub fn alignment(&self) -> u64 {
        if self.partial_hits {
            self.h
        } else {
            self.s
        }
    }

    fn active(&self, group: usize) -> bool {
        self.per_block[group] > 0
    }

    /// This planner keying with a deployment secret: every key's hash part becomes
    /// `BLAKE3_keyed(k_name, u32_le(|prefix|) ‖ prefix ‖ block_hash)` (as long as the block
    /// hash), so keys cannot be computed (or probed) without the secret.
    pub fn with_secret(mut self, secret: &[u8]) -> Result<Self> {
        self.secret = Some(std::sync::Arc::new(Secret::new(secret)?));
        Ok(self)
    }

    pub fn has_secret(&self) -> bool {
        self.secret.is_some()
    }

    /// `prefix ‖ hex(hash part)` into `key` (cleared first).
    fn write_key(&self, key: &mut String, prefix: &str, block_hash: &[u8]) {
        key.clear();
        key.push_str(prefix);
        match &self.secret {
            None => push_hex(key, block_hash),
            Some(secret) => {
                let mut out = [0u8; 64];
                let mut long = Vec::new();
                let out: &mut [u8] = if block_hash.len() <= 64 {
                    &mut out[..block_hash.len()]
                } else {
                    long.resize(block_hash.len(), 0);
                    &mut long
                };
                secret.name_hash(prefix, block_hash, out);
                push_hex(key, out);
            }
        }
    }

    /// This rank's key for a block hash of a group.
    pub fn key(&self, group: usize, block_hash: &[u8]) -> String {
        let prefix = &self.own_prefix[group];
        let mut key = String::with_capacity(prefix.len() + block_hash.len() * 2);
        self.write_key(&mut key, prefix, block_hash);
        key
    }

    /// The blocks of a window group the next token after `x` tokens attends to.
    fn needed_blocks(&self, group: usize, x: u64) -> std::ops::Range<u64> {
        let spec = &self.groups[group];
        let window = spec.window.unwrap_or(1);
        let lo = match spec.kind {
            GroupKind::ChunkedLocal => x / window * window,
            _ => (x + 1).saturating_sub(window),
        };
        if lo >= x {
            return 0..0;
        }
        let b = self.effective[group];
        lo / b..cdiv(x, b)
    }

    /// The hash index keying the part of block `b` that lies before `x` tokens.
    fn block_key_index(&self, group: usize, b: u64, x: u64) -> usize {
        (((b + 1) * self.effective[group]).min(x) / self.h - 1) as usize
    }

    fn tokens_hashed(&self, num_hashes: usize) -> u64 {
        num_hashes as u64 * self.h
    }

    /// Plan entry if the block table has a real block there and this rank writes it.
    fn source_block(&self, block_ids: &[Vec<u64>], group: usize, b: u64) -> Option<u64> {
        let id = *block_ids.get(group)?.get(b as usize)?;
        (id != NULL_BLOCK).then_some(id)
    }

    fn this_rank_puts(&self, group: usize, b: u64) -> bool {
        rank_puts_block(b, group, self.tp_rank, self.replication[group])
    }

    fn finish_puts<H: AsRef<[u8]>>(
        &self,
        hashes: &[H],
        entries: Vec<(usize, usize, u64)>,
        exists: &dyn Fn(&str) -> bool,
    ) -> Vec<Transfer> {
        let mut seen = HashSet::with_capacity(entries.len());
        entries
            .into_iter()
            .map(|(group, hash_index, block_id)| Transfer {
                key: self.key(group, hashes[hash_index].as_ref()),
                group,
                block_id,
            })
            .filter(|t| seen.insert(t.key.clone()) && !exists(&t.key))
            .collect()
    }

    fn check_saved_offset(&self, saved_offset: u64) -> Result<()> {
        if saved_offset % self.s != 0 {
            return Err(Error::new(format!(
                "saved_offset={saved_offset} is not a multiple of scheduler_block_size={} \
                 (a saved offset only ever advances to a save end)",
                self.s
            )));
        }
        Ok(())
    }

    /// §4: the blocks computed since `saved_offset` that this rank stores.
    pub fn plan_save<H: AsRef<[u8]>>(
        &self,
        hashes: &[H],
        block_ids: &[Vec<u64>],
        num_tokens: u64,
        saved_offset: u64,
        exists: &dyn Fn(&str) -> bool,
    ) -> Result<SavePlan> {
        self.plan_save_from(0, hashes, block_ids, num_tokens, saved_offset, exists)
    }

    /// The first token a save from `saved_offset` reads: [`plan_save_from`](Self::plan_save_from)
    /// needs block hashes and block ids from there on only, which keeps a step's planning
    /// cost independent of the context before it. A multiple of the scheduler block.
    pub fn save_base(&self, saved_offset: u64) -> u64 {
        // Window blocks are read from `saved_offset / b_g` on and a key's hash from the hash
        // block before `saved_offset` on: one scheduler block below covers both.
        (saved_offset / self.s * self.s).saturating_sub(self.s)
    }

    /// The base a save from `saved_offset` is planned from, given how many block hashes the
    /// caller holds (`None`: unknown, the inputs are then read whole): [`save_base`]
    /// (Self::save_base) when the hashes reach it, else 0 (a short input is read whole and the
    /// plan words the error).
    pub fn save_base_for(&self, saved_offset: u64, hashes_held: Option<usize>) -> u64 {
        let base = self.save_base(saved_offset);
        match hashes_held {
            Some(held) if held >= self.rows_at(base).0 => base,
            _ => 0,
        }
    }

    /// Where token `base` falls in the inputs of a plan: the hash index, and the row of each
    /// group's block table.
    pub fn rows_at(&self, base: u64) -> (usize, Vec<usize>) {
        let first_hash = (base / self.h) as usize;
        (first_hash, self.effective.iter().map(|&b| (base / b) as usize).collect())
    }

    /// [`plan_save`](Self::plan_save) given only the block hashes and block ids from token
    /// `base` on: `hashes[i]` is the hash of hash block `base / H + i`, `block_ids[g][j]` is the
    /// block `base / b_g + j` of group `g`. `base` is a multiple of the scheduler block at or
    /// below [`save_base`](Self::save_base)`(saved_offset)`.
    pub fn plan_save_from<H: AsRef<[u8]>>(
        &self,
        base: u64,
        hashes: &[H],
        block_ids: &[Vec<u64>],
        num_tokens: u64,
        saved_offset: u64,
        exists: &dyn Fn(&str) -> bool,
    ) -> Result<SavePlan> {
        self.plan_admitted_save_from(base, hashes, block_ids, num_tokens, saved_offset, None, exists)
    }

    /// [`plan_save_from`](Self::plan_save_from) under §8 admission: with `boundaries`
    /// (from [`hit_boundaries`](Self::hit_boundaries)), a window group writes only the blocks
    /// the window tail of one of them needs; `None` writes every window tail (dense).
    #[allow(clippy::too_many_arguments)]
    pub fn plan_admitted_save_from<H: AsRef<[u8]>>(
        &self,
        base: u64,
        hashes: &[H],
        block_ids: &[Vec<u64>],
        num_tokens: u64,
        saved_offset: u64,
        boundaries: Option<&[u64]>,
        exists: &dyn Fn(&str) -> bool,
    ) -> Result<SavePlan> {
        self.check_saved_offset(saved_offset)?;
        if let Some(bad) = boundaries.and_then(|bs| bs.iter().find(|&&x| x % self.alignment() != 0)) {
            return Err(Error::new(format!(
                "admitted boundary {bad} is not a multiple of the alignment {} (use hit_boundaries)",
                self.alignment()
            )));
        }
        if base % self.s != 0 || base > self.save_base(saved_offset) {
            return Err(Error::new(format!(
                "base={base} must be a multiple of scheduler_block_size={} at or below \
                 save_base(saved_offset={saved_offset})={}",
                self.s,
                self.save_base(saved_offset)
            )));
        }
        let (first_hash, first_rows) = self.rows_at(base);
        let covered = num_tokens.min(self.tokens_hashed(first_hash + hashes.len()));
        let end = (covered / self.s * self.s).max(saved_offset);
        let mut entries = Vec::new();
        for g in (0..self.groups.len()).filter(|&g| self.active(g)) {
            let b_g = self.effective[g];
            let kind = self.groups[g].kind;
            let blocks: Vec<(u64, u64)> = if kind == GroupKind::Mamba {
                // Its interior slots may hold freed blocks (vLLM F8): only hand-offs store it.
                Vec::new()
            } else if kind.is_window() {
                let mut wanted = std::collections::BTreeMap::new();
                let mut x = saved_offset + self.s;
                while x <= end {
                    for b in self.needed_blocks(g, x) {
                        if b >= saved_offset / b_g {
                            wanted.insert(b, x);
                        }
                    }
                    x += self.s;
                }
                if let Some(admitted) = boundaries {
                    wanted.retain(|&b, _| admitted.iter().any(|&x| self.needed_blocks(g, x).contains(&b)));
                }
                wanted.into_iter().collect()
            } else {
                (saved_offset / b_g..end / b_g).map(|b| (b, end)).collect()
            };
            let first_block = first_rows[g] as u64;
            for (b, x) in blocks {
                if !self.this_rank_puts(g, b) {
                    continue;
                }
                // save_base keeps both reads at or above the base; a caller's base above it
                // was refused before this loop.
                let below = || Error::new(format!("plan_save read group {g} block {b} below base={base}"));
                let row = b.checked_sub(first_block).ok_or_else(below)? as usize;
                let key_index = self.block_key_index(g, b, x).checked_sub(first_hash).ok_or_else(below)?;
                let table = block_ids.get(g).map(Vec::as_slice).unwrap_or(&[]);
                if let Some(id) = table.get(row).copied().filter(|&id| id != NULL_BLOCK) {
                    entries.push((g, key_index, id));
                }
            }
        }
        Ok(SavePlan {
            end,
            puts: self.finish_puts(hashes, entries, exists),
        })
    }

    /// §5: the puts that make a partial-tail boundary servable from the store.
    pub fn plan_tail<H: AsRef<[u8]>>(
        &self,
        hashes: &[H],
        block_ids: &[Vec<u64>],
        handoffs: &[(usize, u64, u64)],
        saved_offset: u64,
        exists: &dyn Fn(&str) -> bool,
    ) -> Result<TailPlan> {
        let plan = |outcome, boundary| {
            Ok(TailPlan {
                outcome,
                boundary,
                puts: Vec::new(),
            })
        };
        if hashes.is_empty() || handoffs.is_empty() {
            return plan(TailOutcome::None, None);
        }
        let first = handoffs[0].2;
        let agreed = handoffs.iter().all(|h| h.2 == first).then_some(first);
        let a = self.alignment();
        if handoffs.iter().any(|h| h.2 == 0 || h.2 % a != 0) {
            return plan(TailOutcome::InvalidBoundary, agreed);
        }
        let Some(boundary) = agreed else {
            return plan(TailOutcome::DivergentBoundaries, None);
        };
        if boundary / self.h > hashes.len() as u64 {
            return plan(TailOutcome::HashPending, Some(boundary));
        }
        let mut entries = Vec::new();
        for g in (0..self.groups.len()).filter(|&g| self.active(g)) {
            let b_g = self.effective[g];
            let last = cdiv(boundary, b_g) - 1;
            let kind = self.groups[g].kind;
            if kind == GroupKind::Mamba {
                let handoff = handoffs
                    .iter()
                    .rev()
                    .find(|h| h.0 == g && h.1 != NULL_BLOCK);
                if let Some(&(_, block_id, _)) = handoff {
                    if self.this_rank_puts(g, last) {
                        entries.push((g, (boundary / self.h - 1) as usize, block_id));
                    }
                }
                continue;
            }
            let from = (saved_offset / b_g).min(last);
            let blocks = if kind.is_window() {
                let needed = self.needed_blocks(g, boundary);
                needed.start.max(from)..needed.end
            } else {
                from..last + 1
            };
            for b in blocks {
                if !self.this_rank_puts(g, b) {
                    continue;
                }
                if let Some(id) = self.source_block(block_ids, g, b) {
                    entries.push((g, self.block_key_index(g, b, boundary), id));
                }
            }
        }
        if entries.is_empty() {
            return plan(TailOutcome::None, Some(boundary));
        }
        let puts = self.finish_puts(hashes, entries, exists);
        let outcome = if puts.is_empty() {
            TailOutcome::AllPresent
        } else {
            TailOutcome::Planned
        };
        Ok(TailPlan {
            outcome,
            boundary: Some(boundary),
            puts,
        })
    }

    /// §8: the boundaries of a prompt of `num_prompt_tokens` tokens a later lookup can hit at,
    /// whose window tails its saves keep. `retention_interval` is vLLM's
    /// `prefix_cache_retention_interval`: `None` (dense checkpoints) admits every boundary
    /// (returns `None`); `0` the prompt's ends and its junction; `T > 0` also every `T` tokens.
    /// `seen[i]` says whether the prefix ending at boundary `(i + 1) · a` was seen before (the
    /// hashes of [`boundary_hash_indices`](Self::boundary_hash_indices)); the deepest seen one is
    /// the junction.
    pub fn hit_boundaries(&self, num_prompt_tokens: u64, retention_interval: Option<u64>, seen: &[bool]) -> Option<Vec<u64>> {
        let interval = retention_interval?;
        let a = self.alignment();
        let n = num_prompt_tokens;
        let mut out = std::collections::BTreeSet::new();
        if n > 0 {
            out.insert((n - 1) / a * a); // a resend: its last token is computed (§6)
            out.insert(n / a * a); // a longer prompt extending this one
        }
        if let Some(periods) = n.checked_div(interval) {
            out.extend((1..=periods).map(|k| k * interval / a * a)); // vLLM's periodic checkpoints
        }
        if let Some(i) = seen.iter().rposition(|&s| s) {
            out.insert(((i as u64 + 1) * a).min(n / a * a));
        }
        out.remove(&0);
        Some(out.into_iter().collect())
    }

    /// The hash index naming each boundary `a, 2a, …` up to `num_tokens` that the hashes
    /// cover: two prompts whose hashes agree there share the prefix up to it (§8 junctions).
    pub fn boundary_hash_indices(&self, num_hashes: usize, num_tokens: u64) -> Vec<usize> {
        let a = self.alignment();
        let limit = num_tokens.min(self.tokens_hashed(num_hashes));
        (1..=limit / a).map(|k| (k * a / self.h - 1) as usize).collect()
    }

    /// The largest length the lookup may test for a request of `num_tokens` tokens.
    fn lookup_limit(&self, num_hashes: usize, num_tokens: u64) -> u64 {
        let a = self.alignment();
        num_tokens.min(self.tokens_hashed(num_hashes)) / a * a
    }

    /// Every `(group, hash index)` the hit test can consult for lengths up to the limit,
    /// ordered by group, then hash index, without duplicate keys: a hash repeated at a later
    /// index of the same group keys the same value and is left out.
    pub fn lookup_candidates<H: AsRef<[u8]>>(
        &self,
        hashes: &[H],
        num_tokens: u64,
    ) -> Vec<Candidate> {
        self.unique_candidates(hashes, num_tokens, has_repeats(hashes))
    }

    fn unique_candidates<H: AsRef<[u8]>>(
        &self,
        hashes: &[H],
        num_tokens: u64,
        repeats: bool,
    ) -> Vec<Candidate> {
        let all = self.candidate_positions(hashes.len(), num_tokens);
        if !repeats {
            return all;
        }
        let mut seen = HashSet::new();
        all.into_iter()
            .filter(|c| seen.insert((c.group, hashes[c.hash_index].as_ref())))
            .collect()
    }

    /// The `(group, hash index)` pairs the hit test consults, repeated hashes included.
    fn candidate_positions(&self, num_hashes: usize, num_tokens: u64) -> Vec<Candidate> {
        let limit = self.lookup_limit(num_hashes, num_tokens);
        let a = self.alignment();
        let mut out = Vec::new();
        let mut wanted = vec![false; (limit / self.h) as usize];
        for g in (0..self.groups.len()).filter(|&g| self.active(g)) {
            wanted.iter_mut().for_each(|w| *w = false);
            let b_g = self.effective[g];
            let kind = self.groups[g].kind;
            let mut x = a;
            while x <= limit {
                if kind == GroupKind::Mamba {
                    wanted[(x / self.h - 1) as usize] = true;
                } else if kind.is_window() {
                    for b in self.needed_blocks(g, x) {
                        wanted[self.block_key_index(g, b, x)] = true;
                    }
                } else {
                    // The sub-hash at x (x itself when x ends a block); block ends below.
                    wanted[(x / self.h - 1) as usize] = true;
                }
                x += a;
            }
            if !kind.is_window() && kind != GroupKind::Mamba {
                let mut end = b_g;
                while end <= limit {
                    wanted[(end / self.h - 1) as usize] = true;
                    end += b_g;
                }
            }
            out.extend(
                wanted
                    .iter()
                    .enumerate()
                    .filter(|(_, &w)| w)
                    .map(|(hash_index, _)| Candidate {
                        group: g,
                        hash_index,
                    }),
            );
        }
        out
    }

    /// The key strings of `lookup_candidates`, each in every TP namespace some rank loads.
    pub fn lookup_keys<H: AsRef<[u8]>>(&self, hashes: &[H], num_tokens: u64) -> Vec<String> {
        let candidates = self.lookup_candidates(hashes, num_tokens);
        let mut keys = Vec::with_capacity(self.lookup_key_count(&candidates));
        self.for_each_candidate_key(hashes, &candidates, |key| keys.push(key.to_owned()));
        keys
    }

    /// How many keys `candidates` expand to.
    pub fn lookup_key_count(&self, candidates: &[Candidate]) -> usize {
        candidates
            .iter()
            .map(|c| self.namespaces_per_group(c.group))
            .sum()
    }

    /// The keys of `candidates` (from `lookup_candidates` on the same hashes), in order. Each
    /// hash is hexed once however many groups and namespaces use it (the groups of a hybrid
    /// share most hash indices).
    pub fn for_each_candidate_key<H: AsRef<[u8]>>(
        &self,
        hashes: &[H],
        candidates: &[Candidate],
        mut f: impl FnMut(&str),
    ) {
        // hex_at[i]: where hash i's hex digits start in `hexed` (u32::MAX: not hexed yet).
        let mut hex_at = vec![u32::MAX; hashes.len()];
        let mut hexed = String::new();
        let mut key = String::with_capacity(256);
        if self.secret.is_some() {
            // Keyed: every (prefix, hash) has its own hash part.
            for c in candidates {
                let hash = hashes[c.hash_index].as_ref();
                for prefix in &self.lookup_prefixes[c.group] {
                    self.write_key(&mut key, prefix, hash);
                    f(&key);
                }
            }
            return;
        }
        for c in candidates {
            let hash = hashes[c.hash_index].as_ref();
            let at = match hex_at[c.hash_index] {
                u32::MAX => {
                    let at = hexed.len();
                    push_hex(&mut hexed, hash);
                    hex_at[c.hash_index] = at as u32;
                    at
                }
                at => at as usize,
            };
            let digits = &hexed[at..at + 2 * hash.len()];
            for prefix in &self.lookup_prefixes[c.group] {
                key.clear();
                key.push_str(prefix);
                key.push_str(digits);
                f(&key);
            }
        }
    }

    /// How many keys each candidate expands to (one per key TP rank of its group).
    pub fn namespaces_per_group(&self, group: usize) -> usize {
        self.lookup_prefixes[group].len()
    }

    /// §6 from a bitmap aligned with `lookup_keys`.
    pub fn longest_hit_bitmap<H: AsRef<[u8]>>(
        &self,
        hashes: &[H],
        num_tokens: u64,
        bitmap: &[bool],
    ) -> Result<u64> {
        let num_hashes = hashes.len();
        let repeats = has_repeats(hashes);
        let candidates = self.unique_candidates(hashes, num_tokens, repeats);
        let expected = self.lookup_key_count(&candidates);
        if bitmap.len() != expected {
            return Err(Error::new(format!(
                "the existence bitmap has {} entries but lookup_keys gives {expected} keys for \
                 these hashes and num_tokens={num_tokens}",
                bitmap.len()
            )));
        }
        let mut present = vec![Vec::new(); self.groups.len()];
        let mut bits = bitmap.iter();
        for c in &candidates {
            let n = self.namespaces_per_group(c.group);
            let all = bits.by_ref().take(n).fold(true, |acc, &b| acc & b);
            let row = &mut present[c.group];
            if row.len() <= c.hash_index {
                row.resize(c.hash_index + 1, false);
            }
            row[c.hash_index] = all;
        }
        if repeats {
            // A repeated hash keys the same value as the candidate that was kept for it.
            let kept: std::collections::HashMap<(usize, &[u8]), bool> = candidates
                .iter()
                .map(|c| {
                    (
                        (c.group, hashes[c.hash_index].as_ref()),
                        present[c.group][c.hash_index],
                    )
                })
                .collect();
            for c in self.candidate_positions(num_hashes, num_tokens) {
                let value = kept[&(c.group, hashes[c.hash_index].as_ref())];
                let row = &mut present[c.group];
                if row.len() <= c.hash_index {
                    row.resize(c.hash_index + 1, false);
                }
                row[c.hash_index] = value;
            }
        }
        Ok(self.longest_hit_with(num_hashes, num_tokens, &present))
    }

    /// §6 with a predicate over key strings.
    pub fn longest_hit<H: AsRef<[u8]>>(
        &self,
        hashes: &[H],
        num_tokens: u64,
        present: &dyn Fn(&str) -> bool,
    ) -> u64 {
        let keys = self.lookup_keys(hashes, num_tokens);
        let bitmap: Vec<bool> = keys.iter().map(|k| present(k)).collect();
        self.longest_hit_bitmap(hashes, num_tokens, &bitmap)
            .expect("the bitmap is built from lookup_keys")
    }

    /// The hit given, per group, which hash indices are present in every namespace.
    fn longest_hit_with(&self, num_hashes: usize, num_tokens: u64, present: &[Vec<bool>]) -> u64 {
        let a = self.alignment();
        let limit = self.lookup_limit(num_hashes, num_tokens);
        let has = |g: usize, index: u64| -> bool {
            present[g].get(index as usize).copied().unwrap_or(false)
        };
        // For full-attention kinds: how many leading blocks have their end key present (0 for
        // the other groups, whose blocks may be smaller than a hash block: a scratch ring).
        let full_like = |g: usize| {
            let kind = self.groups[g].kind;
            self.active(g) && kind != GroupKind::Mamba && !kind.is_window()
        };
        let leading_full: Vec<u64> = (0..self.groups.len())
            .map(|g| {
                if !full_like(g) {
                    return 0;
                }
                let b_g = self.effective[g];
                let mut blocks = 0;
                while (blocks + 1) * b_g <= limit && has(g, (blocks + 1) * b_g / self.h - 1) {
                    blocks += 1;
                }
                blocks
            })
            .collect();
        let servable = |x: u64| -> bool {
            (0..self.groups.len()).filter(|&g| self.active(g)).all(|g| {
                let b_g = self.effective[g];
                let kind = self.groups[g].kind;
                if kind == GroupKind::Mamba {
                    has(g, x / self.h - 1)
                } else if kind.is_window() {
                    self.needed_blocks(g, x)
                        .all(|b| has(g, self.block_key_index(g, b, x) as u64))
                } else {
                    x / b_g <= leading_full[g] && (x % b_g == 0 || has(g, x / self.h - 1))
                }
            })
        };
        let best_up_to = |limit: u64| -> u64 {
            let mut x = limit;
            while x > 0 && !servable(x) {
                x -= a;
            }
            x
        };
        let hit = best_up_to(limit);
        if hit > 0 && hit >= num_tokens {
            // Nothing would be left to compute: vLLM needs at least one token to run.
            return best_up_to((num_tokens - 1) / a * a);
        }
        hit
    }

    /// The saved offset of a request once a load of `hit_tokens` completed: the loaded
    /// prefix is in the store, so its saves start at the last scheduler block it covers.
    pub fn saved_offset_after_load(&self, hit_tokens: u64) -> u64 {
        hit_tokens / self.s * self.s
    }

    /// §7: the blocks of group `g` a load of a hit of `hit` tokens reads from the scheduler
    /// block `start` (a multiple of S) on; `hit > start`.
    fn load_blocks(&self, g: usize, start: u64, hit: u64) -> std::ops::Range<u64> {
        let b_g = self.effective[g];
        let kind = self.groups[g].kind;
        let first = start / b_g;
        if kind == GroupKind::Mamba {
            cdiv(hit, b_g) - 1..cdiv(hit, b_g)
        } else if kind.is_window() {
            let needed = self.needed_blocks(g, hit);
            needed.start.max(first)..needed.end
        } else {
            first..cdiv(hit, b_g)
        }
    }

    /// §7: per group, how many values a load of a hit of `hit` tokens reads with nothing
    /// local: the hit's boundary set, what the store must hold for it (0 where the group
    /// takes no part, and in every group for a hit of 0).
    pub fn hit_set_blocks(&self, hit: u64) -> Vec<u64> {
        (0..self.groups.len())
            .map(|g| match hit > 0 && self.active(g) {
                true => {
                    let blocks = self.load_blocks(g, 0, hit);
                    blocks.end.saturating_sub(blocks.start)
                }
                false => 0,
            })
            .collect()
    }

    /// §7: what to get, into which destination blocks, for a hit of `hit` tokens over a
    /// local prefix of `local_tokens`.
    pub fn plan_load<H: AsRef<[u8]>>(
        &self,
        hashes: &[H],
        block_ids: &[Vec<u64>],
        hit: u64,
        local_tokens: u64,
    ) -> Result<LoadPlan> {
        let a = self.alignment();
        if hit % a != 0 || hit > self.tokens_hashed(hashes.len()) {
            return Err(Error::new(format!(
                "hit_tokens={hit} must be a multiple of the lookup alignment {a} covered by the \
                 {} hashes given (as longest_hit returns)",
                hashes.len()
            )));
        }
        if local_tokens > hit {
            return Err(Error::new(format!(
                "local_tokens={local_tokens} exceeds hit_tokens={hit}: nothing to load"
            )));
        }
        let start = local_tokens / self.s * self.s;
        let mut gets = Vec::new();
        let mut missing = Vec::new();
        if hit > start {
            for g in (0..self.groups.len()).filter(|&g| self.active(g)) {
                let kind = self.groups[g].kind;
                for b in self.load_blocks(g, start, hit) {
                    let index = if kind == GroupKind::Mamba {
                        (hit / self.h - 1) as usize
                    } else {
                        self.block_key_index(g, b, hit)
                    };
                    match self.source_block(block_ids, g, b) {
                        Some(id) => gets.push(Transfer {
                            key: self.key(g, hashes[index].as_ref()),
                            group: g,
                            block_id: id,
                        }),
                        None => missing.push((g, b)),
                    }
                }
            }
        }
        Ok(LoadPlan {
            hit,
            start,
            gets,
            missing,
        })
    }
}

/// Whether some hash value occurs twice (never for real chained hashes; tests make it so).
/// FxHash: block hashes are already uniform, so SipHash's cost buys nothing here.
fn has_repeats<H: AsRef<[u8]>>(hashes: &[H]) -> bool {
    let mut seen =
        rustc_hash::FxHashSet::with_capacity_and_hasher(hashes.len(), Default::default());
    !hashes.iter().all(|h| seen.insert(h.as_ref()))
}

/// Unique keys of a get batch in first-seen order, and for each the indices it feeds:
/// a key asked twice is fetched once and copied to every destination.
pub fn dedup_gets(keys: &[&str]) -> (Vec<String>, Vec<Vec<usize>>) {
    let mut order: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let mut unique = Vec::new();
    let mut targets: Vec<Vec<usize>> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let slot = *order.entry(key).or_insert_with(|| {
            unique.push(key.to_string());
            targets.push(Vec::new());
            unique.len() - 1
        });
        targets[slot].push(i);
    }
    (unique, targets)
}
