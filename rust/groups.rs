//! SEMANTICS §2: group kinds, effective block sizes, the scheduler / hash block sizes (S, H)
//! and which groups take part in keying at all.

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GroupKind {
    FullAttention,
    Mla,
    SlidingWindow,
    ChunkedLocal,
    Mamba,
    CircularBuffer,
}

impl GroupKind {
    pub const NAMES: [&'static str; 6] = [
        "full_attention",
        "mla",
        "sliding_window",
        "chunked_local",
        "mamba",
        "circular_buffer",
    ];

    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "full_attention" => GroupKind::FullAttention,
            "mla" => GroupKind::Mla,
            "sliding_window" => GroupKind::SlidingWindow,
            "chunked_local" => GroupKind::ChunkedLocal,
            "mamba" => GroupKind::Mamba,
            "circular_buffer" => GroupKind::CircularBuffer,
            other => {
                return Err(Error::new(format!(
                    "unknown group kind {other:?}; use one of {}",
                    Self::NAMES.join(", ")
                )))
            }
        })
    }

    /// `prefix_cacheable` when a group does not say: every kind but the circular buffer.
    pub fn default_prefix_cacheable(self) -> bool {
        self != GroupKind::CircularBuffer
    }

    pub fn name(self) -> &'static str {
        match self {
            GroupKind::FullAttention => "full_attention",
            GroupKind::Mla => "mla",
            GroupKind::SlidingWindow => "sliding_window",
            GroupKind::ChunkedLocal => "chunked_local",
            GroupKind::Mamba => "mamba",
            GroupKind::CircularBuffer => "circular_buffer",
        }
    }

    pub fn is_window(self) -> bool {
        matches!(self, GroupKind::SlidingWindow | GroupKind::ChunkedLocal)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MambaMode {
    Align,
    All,
    None,
}

impl MambaMode {
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "align" => MambaMode::Align,
            "all" => MambaMode::All,
            "none" => MambaMode::None,
            other => {
                return Err(Error::new(format!(
                    "unknown mamba_mode {other:?}; use \"align\", \"all\" or \"none\""
                )))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            MambaMode::Align => "align",
            MambaMode::All => "all",
            MambaMode::None => "none",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GroupSpec {
    pub kind: GroupKind,
    pub block_size: u64,
    pub window: Option<u64>,
    pub mamba_mode: MambaMode,
    pub prefix_cacheable: bool,
    pub num_kv_heads: Option<u64>,
}

impl GroupSpec {
    /// A validated group; `prefix_cacheable = None` takes the kind's default.
    pub fn new(
        kind: GroupKind,
        block_size: u64,
        window: Option<u64>,
        mamba_mode: MambaMode,
        prefix_cacheable: Option<bool>,
        num_kv_heads: Option<u64>,
    ) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::new(format!(
                "block_size=0 for a {} group: a block holds a positive number of tokens",
                kind.name()
            )));
        }
        match (kind.is_window(), window) {
            (true, None) | (true, Some(0)) => {
                return Err(Error::new(format!(
                    "a {} group needs window=<positive tokens> ({}), got {:?}",
                    kind.name(),
                    if kind == GroupKind::SlidingWindow {
                        "the sliding window"
                    } else {
                        "the local attention chunk"
                    },
                    window
                )))
            }
            (false, Some(w)) => {
                return Err(Error::new(format!(
                    "window={w} given for a {} group; only sliding_window and chunked_local \
                     groups have a window",
                    kind.name()
                )))
            }
            _ => {}
        }
        if num_kv_heads == Some(0) {
            return Err(Error::new(
                "num_kv_heads=0: use a positive head count or None",
            ));
        }
        Ok(GroupSpec {
            kind,
            block_size,
            window,
            mamba_mode,
            prefix_cacheable: prefix_cacheable.unwrap_or(kind.default_prefix_cacheable()),
            num_kv_heads,
        })
    }

    pub fn full_attention(block_size: u64) -> Self {
        Self::new(
            GroupKind::FullAttention,
            block_size,
            None,
            MambaMode::Align,
            None,
            None,
        )
        .unwrap()
    }

    pub fn mamba(block_size: u64, mode: MambaMode) -> Self {
        Self::new(GroupKind::Mamba, block_size, None, mode, None, None).unwrap()
    }

    pub fn of_kind(kind: GroupKind, block_size: u64, window: Option<u64>) -> Result<Self> {
        Self::new(kind, block_size, window, MambaMode::Align, None, None)
    }

    /// Tokens one block covers across the DCP ranks (`mamba` state is not sharded by DCP).
    pub fn effective_size(&self, dcp: u64) -> u64 {
        if self.kind == GroupKind::Mamba {
            self.block_size
        } else {
            self.block_size * dcp
        }
    }

    pub fn describe(&self, index: usize, dcp: u64) -> String {
        format!(
            "group {index} ({}, {} tokens)",
            self.kind.name(),
            self.effective_size(dcp)
        )
    }
}

pub fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

pub fn lcm(a: u64, b: u64) -> Option<u64> {
    (a / gcd(a, b)).checked_mul(b)
}

/// The groups that take part in keying: the prefix-cacheable ones, or all when none is.
pub fn participating(groups: &[GroupSpec]) -> Vec<bool> {
    let any_cacheable = groups.iter().any(|g| g.prefix_cacheable);
    groups
        .iter()
        .map(|g| g.prefix_cacheable || !any_cacheable)
        .collect()
}

fn check_dcp(dcp: u64) -> Result<()> {
    if dcp == 0 {
        return Err(Error::new(
            "dcp=0: the decode context parallel size is at least 1",
        ));
    }
    Ok(())
}

/// `(S, H)` for a group mix (SEMANTICS §2).
pub fn resolve_block_sizes(
    groups: &[GroupSpec],
    prefix_match_unit: Option<u64>,
    dcp: u64,
) -> Result<(u64, u64)> {
    check_dcp(dcp)?;
    if groups.is_empty() {
        return Err(Error::new(
            "no KV-cache groups: pass at least one GroupSpec",
        ));
    }
    if prefix_match_unit == Some(0) {
        return Err(Error::new(
            "prefix_match_unit=0: use a positive number of tokens or None",
        ));
    }
    if groups.len() == 1 {
        // SEMANTICS §2 rule 1 says block_size * dcp; for a lone mamba group we keep its
        // unsharded state size (rule 2's effective size), else no planner could key it.
        let size = groups[0].effective_size(dcp);
        if let Some(unit) = prefix_match_unit {
            if unit != size {
                return Err(Error::new(format!(
                    "prefix_match_unit={unit} with a single group of {size} tokens: hits of one \
                     group can only land on its block size; use prefix_match_unit={size} or None"
                )));
            }
        }
        return Ok((size, size));
    }
    let effective: Vec<u64> = groups.iter().map(|g| g.effective_size(dcp)).collect();
    let mut s = 1u64;
    for &e in &effective {
        s = lcm(s, e).ok_or_else(|| {
            Error::new(format!(
                "the lcm of block sizes {effective:?} overflows 64 bits"
            ))
        })?;
    }
    let non_align: Vec<usize> = groups
        .iter()
        .enumerate()
        .filter(|(_, g)| g.kind == GroupKind::Mamba && g.mamba_mode != MambaMode::Align)
        .map(|(i, _)| i)
        .collect();
    let takes_part = participating(groups);
    let h = if !non_align.is_empty() {
        s
    } else if let Some(unit) = prefix_match_unit {
        unit
    } else {
        effective
            .iter()
            .zip(&takes_part)
            .filter(|(_, &p)| p)
            .fold(0, |acc, (&e, _)| gcd(acc, e))
    };
    let offending: Vec<usize> = (0..groups.len())
        .filter(|&i| takes_part[i] && effective[i] % h != 0)
        .collect();
    if offending.is_empty() {
        return Ok((s, h));
    }
    let names: Vec<String> = offending
        .iter()
        .map(|&i| groups[i].describe(i, dcp))
        .collect();
    let participating_gcd = effective
        .iter()
        .zip(&takes_part)
        .filter(|(_, &p)| p)
        .fold(0, |acc, (&e, _)| gcd(acc, e));
    let advice =
        if !non_align.is_empty() {
            let modes: Vec<String> = non_align
                .iter()
                .map(|&i| format!("group {i} (mamba, mode {})", groups[i].mamba_mode.name()))
                .collect();
            format!(
            "H is the lcm S={s} because {} is not in align mode; set mamba_mode=\"align\" on it \
             (then H can be the gcd {participating_gcd}), or make every prefix-cacheable block \
             size {s}, or mark {} prefix_cacheable=False",
            modes.join(", "),
            if offending.len() == 1 { "that group" } else { "those groups" }
        )
        } else {
            format!(
            "use a prefix_match_unit that divides every prefix-cacheable block size (their gcd \
             is {participating_gcd}; any divisor of it works), or mark {} prefix_cacheable=False",
            if offending.len() == 1 { "that group" } else { "those groups" }
        )
        };
    Err(Error::new(format!(
        "{} {} not a multiple of the hash block size H={h}: {advice}",
        names.join(", "),
        if offending.len() == 1 { "is" } else { "are" }
    )))
}

/// Hashes per block `e_g / H` for participating groups, 0 for skipped ones.
pub fn hashes_per_block(groups: &[GroupSpec], hash_block_size: u64, dcp: u64) -> Result<Vec<u64>> {
    check_dcp(dcp)?;
    if groups.is_empty() {
        return Err(Error::new(
            "no KV-cache groups: pass at least one GroupSpec",
        ));
    }
    if hash_block_size == 0 {
        return Err(Error::new(
            "hash_block_size=0: use a positive number of tokens",
        ));
    }
    let takes_part = participating(groups);
    let mut offending = Vec::new();
    let per_block = groups
        .iter()
        .enumerate()
        .map(|(i, g)| {
            if !takes_part[i] {
                return 0;
            }
            let e = g.effective_size(dcp);
            if e % hash_block_size != 0 {
                offending.push(g.describe(i, dcp));
            }
            e / hash_block_size
        })
        .collect();
    if !offending.is_empty() {
        return Err(Error::new(format!(
            "{} not a multiple of hash_block_size={hash_block_size}: pick a hash block size \
             that divides every prefix-cacheable block size, or mark the group \
             prefix_cacheable=False",
            offending.join(", ")
        )));
    }
    Ok(per_block)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(size: u64) -> GroupSpec {
        GroupSpec::of_kind(GroupKind::CircularBuffer, size, None).unwrap()
    }

    #[test]
    fn semantics_examples() {
        let fa = GroupSpec::full_attention;
        assert_eq!(
            resolve_block_sizes(&[fa(1152), ring(4)], None, 1),
            Ok((1152, 1152))
        );
        assert_eq!(
            resolve_block_sizes(&[fa(16), GroupSpec::mamba(48, MambaMode::Align)], None, 1),
            Ok((48, 16))
        );
        let err = resolve_block_sizes(&[fa(16), GroupSpec::mamba(24, MambaMode::None)], None, 1)
            .unwrap_err();
        assert!(
            err.0.contains("group 0 (full_attention, 16 tokens)"),
            "{err}"
        );
        assert!(err.0.contains("H=48"), "{err}");
        let mla = |b| GroupSpec::of_kind(GroupKind::Mla, b, None).unwrap();
        let dsv4 = [mla(256), mla(64), mla(64), mla(4), mla(8)];
        assert_eq!(resolve_block_sizes(&dsv4, None, 1), Ok((256, 4)));
        assert_eq!(
            resolve_block_sizes(&[ring(4), ring(8)], None, 1),
            Ok((8, 4))
        );
        assert_eq!(
            resolve_block_sizes(
                &[fa(1536), GroupSpec::mamba(1536, MambaMode::Align)],
                Some(128),
                1
            ),
            Ok((1536, 128))
        );
        assert_eq!(
            hashes_per_block(&[fa(1152), ring(4)], 1152, 1),
            Ok(vec![1, 0])
        );
    }

    #[test]
    fn dcp_scales_attention_only() {
        let groups = [
            GroupSpec::full_attention(16),
            GroupSpec::mamba(16, MambaMode::Align),
        ];
        assert_eq!(resolve_block_sizes(&groups, None, 2), Ok((32, 16)));
        assert_eq!(resolve_block_sizes(&groups[..1], None, 2), Ok((32, 32)));
    }

    #[test]
    fn single_group_rejects_another_match_unit() {
        let err = resolve_block_sizes(&[GroupSpec::full_attention(16)], Some(8), 1).unwrap_err();
        assert!(err.0.contains("prefix_match_unit=8"), "{err}");
    }
}
