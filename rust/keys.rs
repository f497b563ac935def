//! SEMANTICS §3: striding hashes into chunk keys, the key namespace, fingerprints, TP sharding.

use crate::cbor::{self, Value};
use crate::error::{Error, Result};
use crate::groups::{GroupKind, GroupSpec};
use sha2::{Digest, Sha256};

const HEX: &[u8; 16] = b"0123456789abcdef";

pub fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

/// Both hex digits of every byte value.
static HEX_PAIRS: [[u8; 2]; 256] = {
    let mut table = [[0u8; 2]; 256];
    let mut i = 0;
    while i < 256 {
        table[i] = [HEX[i >> 4], HEX[i & 0xf]];
        i += 1;
    }
    table
};

#[inline]
pub fn push_hex(out: &mut String, bytes: &[u8]) {
    // Through a stack buffer: `String::push(char)` per digit costs several times more.
    let mut digits = [0u8; 64];
    for chunk in bytes.chunks(32) {
        for (pair, &b) in digits.chunks_exact_mut(2).zip(chunk) {
            pair.copy_from_slice(&HEX_PAIRS[b as usize]);
        }
        // SAFETY: every byte comes from HEX_PAIRS, i.e. is an ASCII hex digit.
        out.push_str(unsafe { std::str::from_utf8_unchecked(&digits[..2 * chunk.len()]) });
    }
}

/// The hash indices `islice(h, start·k + k − 1, None, k)` picks: chunk `j ≥ start_chunk`
/// is keyed by its last hash. `k = 0` (a skipped group) picks nothing.
pub fn stride_indices(
    num_hashes: usize,
    hashes_per_chunk: usize,
    start_chunk: usize,
) -> Vec<usize> {
    if hashes_per_chunk == 0 {
        return Vec::new();
    }
    let first = start_chunk
        .saturating_mul(hashes_per_chunk)
        .saturating_add(hashes_per_chunk - 1);
    (first..num_hashes).step_by(hashes_per_chunk).collect()
}

pub fn stride_keys<H: Clone>(hashes: &[H], hashes_per_chunk: usize, start_chunk: usize) -> Vec<H> {
    stride_indices(hashes.len(), hashes_per_chunk, start_chunk)
        .into_iter()
        .map(|i| hashes[i].clone())
        .collect()
}

/// `[cache_prefix@]model[@fp:{fingerprint}]@tp_rank:{t}@pcp{p}@dcp{d}@pp_rank:{pp}`.
/// Without a fingerprint it is byte-identical to vLLM's MooncakeStoreConnector namespace.
/// A TP or PP rank left unset (None) is the planner's to give, and reads as 0 in the text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Namespace {
    pub model: String,
    pub cache_prefix: Option<String>,
    pub fingerprint: Option<String>,
    pub tp_rank: Option<u64>,
    pub pcp_rank: u64,
    pub dcp_rank: u64,
    pub pp_rank: Option<u64>,
}

/// The rank a planner keys under: given on one side, that one; on both, they must agree
/// (a silent pick would key one rank's shard under another rank's name).
fn agreed_rank(what: &str, namespace: Option<u64>, planner: Option<u64>) -> Result<u64> {
    match (namespace, planner) {
        (Some(ns), Some(own)) if ns != own => Err(Error::new(format!(
            "the KeyPlanner's {what}={own} disagrees with its Namespace's {what}={ns}: give the \
             rank once (in the Namespace or to the planner), or the same in both"
        ))),
        (ns, own) => Ok(own.or(ns).unwrap_or(0)),
    }
}

impl Namespace {
    pub fn new(model: impl Into<String>) -> Self {
        Namespace {
            model: model.into(),
            cache_prefix: None,
            fingerprint: None,
            tp_rank: None,
            pcp_rank: 0,
            dcp_rank: 0,
            pp_rank: None,
        }
    }

    /// This namespace with the planner's TP and PP ranks set (None: not given to the planner).
    pub fn with_ranks(&self, tp_rank: Option<u64>, pp_rank: Option<u64>) -> Result<Namespace> {
        Ok(Namespace {
            tp_rank: Some(agreed_rank("tp_rank", self.tp_rank, tp_rank)?),
            pp_rank: Some(agreed_rank("pp_rank", self.pp_rank, pp_rank)?),
            ..self.clone()
        })
    }

    pub fn validate(&self) -> Result<()> {
        if self.model.is_empty() {
            return Err(Error::new(
                "namespace model is empty: pass the served model name",
            ));
        }
        for (what, text) in [
            ("model", Some(&self.model)),
            ("cache_prefix", self.cache_prefix.as_ref()),
            ("fingerprint", self.fingerprint.as_ref()),
        ] {
            if let Some(text) = text {
                if text.contains('@') {
                    return Err(Error::new(format!(
                        "namespace {what} {text:?} contains '@', the key field separator; \
                         remove or replace it"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The namespace text with `tp_rank` as the key's TP rank.
    pub fn text(&self, tp_rank: u64) -> String {
        self.text_with(tp_rank, self.dcp_rank)
    }

    /// The namespace text with other TP / DCP ranks. Empty optional parts are left out.
    pub fn text_with(&self, tp_rank: u64, dcp_rank: u64) -> String {
        let mut out = String::new();
        if let Some(prefix) = self.cache_prefix.as_deref().filter(|p| !p.is_empty()) {
            out.push_str(prefix);
            out.push('@');
        }
        out.push_str(&self.model);
        if let Some(fp) = self.fingerprint.as_deref().filter(|f| !f.is_empty()) {
            out.push_str("@fp:");
            out.push_str(fp);
        }
        out.push_str(&format!(
            "@tp_rank:{tp_rank}@pcp{}@dcp{dcp_rank}@pp_rank:{}",
            self.pcp_rank,
            self.pp_rank.unwrap_or(0)
        ));
        out
    }
}

/// 16 hex chars naming a deployment's layout: SHA-256 over the canonical CBOR of its
/// description (dtype, block sizes, layout, hash algorithm, seed, ...).
pub fn layout_fingerprint(description: &Value) -> String {
    hex(&Sha256::digest(cbor::encode(description))[..8])
}

/// `hash ‖ u32_be(group)`: vLLM's OffloadKey.
pub fn key_bytes(group: u32, block_hash: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(block_hash.len() + 4);
    out.extend_from_slice(block_hash);
    out.extend_from_slice(&group.to_be_bytes());
    out
}

/// How many TP ranks hold identical bytes for a group (they share one key).
pub fn replication(group: &GroupSpec, tp_size: u64, dcp: u64) -> u64 {
    if dcp > 1 {
        return 1;
    }
    match group.kind {
        GroupKind::Mla => tp_size,
        GroupKind::Mamba => 1,
        _ => match group.num_kv_heads {
            Some(heads) => (tp_size / heads).max(1),
            None => 1,
        },
    }
}

/// Whether rank `tp_rank` puts block `block` of group `group` (spreads replicated puts).
pub fn rank_puts_block(block: u64, group: usize, tp_rank: u64, replication: u64) -> bool {
    replication <= 1 || block % replication == (tp_rank + group as u64) % replication
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stride_is_islice() {
        let h: Vec<u32> = (0..10).collect();
        assert_eq!(stride_keys(&h, 3, 0), vec![2, 5, 8]);
        assert_eq!(stride_keys(&h, 3, 2), vec![8]);
        assert_eq!(stride_keys(&h, 1, 7), vec![7, 8, 9]);
        assert!(stride_keys(&h, 0, 0).is_empty());
        assert!(stride_keys(&h, 3, 3).is_empty());
        assert!(stride_keys(&h, 3, usize::MAX).is_empty());
    }

    #[test]
    fn namespace_matches_vllm_without_fingerprint() {
        let mut ns = Namespace::new("m");
        assert_eq!(ns.text(1), "m@tp_rank:1@pcp0@dcp0@pp_rank:0");
        ns.cache_prefix = Some("p".into());
        ns.fingerprint = Some("00ff".into());
        assert_eq!(ns.text(0), "p@m@fp:00ff@tp_rank:0@pcp0@dcp0@pp_rank:0");
    }

    #[test]
    fn ranks_given_once_or_agreeing() {
        let mut ns = Namespace::new("m");
        let both = ns.with_ranks(Some(3), Some(2)).unwrap();
        assert_eq!((both.tp_rank, both.pp_rank), (Some(3), Some(2)));
        let none = ns.with_ranks(None, None).unwrap();
        assert_eq!((none.tp_rank, none.pp_rank), (Some(0), Some(0)));
        ns.tp_rank = Some(1);
        ns.pp_rank = Some(4);
        let from_ns = ns.with_ranks(None, None).unwrap();
        assert_eq!((from_ns.tp_rank, from_ns.pp_rank), (Some(1), Some(4)));
        assert!(ns.with_ranks(Some(1), Some(4)).is_ok());
        let err = ns.with_ranks(Some(0), None).unwrap_err().0;
        assert!(
            err.contains("tp_rank=0") && err.contains("tp_rank=1"),
            "{err}"
        );
        let err = ns.with_ranks(None, Some(0)).unwrap_err().0;
        assert!(
            err.contains("pp_rank=0") && err.contains("pp_rank=4"),
            "{err}"
        );
    }

    #[test]
    fn replication_rules() {
        let mla = GroupSpec::of_kind(GroupKind::Mla, 16, None).unwrap();
        let mut fa = GroupSpec::full_attention(16);
        fa.num_kv_heads = Some(2);
        assert_eq!(replication(&mla, 4, 1), 4);
        assert_eq!(replication(&fa, 8, 1), 4);
        assert_eq!(replication(&fa, 1, 1), 1);
        assert_eq!(replication(&mla, 4, 2), 1);
        assert!(rank_puts_block(0, 0, 0, 2) && !rank_puts_block(1, 0, 0, 2));
        assert!(rank_puts_block(1, 0, 1, 2));
    }
}
