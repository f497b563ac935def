//! SEMANTICS §1: chained block hashes, byte-identical to vLLM's `sha256_cbor` / `xxhash_cbor`.
//! `h[i] = HASH(cbor([parent, tokens[i·B:(i+1)·B], extra_i]))`.

use crate::cbor::{self, Value};
use crate::error::{Error, Result};
use rayon::prelude::*;
use sha2::{Digest, Sha256};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashAlgo {
    Sha256Cbor,
    XxhashCbor,
}

impl HashAlgo {
    pub const NAMES: [&'static str; 2] = ["sha256_cbor", "xxhash_cbor"];

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "sha256_cbor" => Ok(HashAlgo::Sha256Cbor),
            "xxhash_cbor" => Ok(HashAlgo::XxhashCbor),
            other => Err(Error::new(format!(
                "unknown hash algorithm {other:?}; use \"sha256_cbor\" or \"xxhash_cbor\" \
                 (vLLM's --prefix-caching-hash-algo values with CBOR serialization)"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::XxhashCbor => "xxhash_cbor",
        }
    }

    pub fn digest_size(self) -> usize {
        match self {
            HashAlgo::Sha256Cbor => 32,
            HashAlgo::XxhashCbor => 16,
        }
    }

    /// The digest of already-encoded bytes.
    #[inline]
    pub fn digest(self, bytes: &[u8]) -> BlockHash {
        match self {
            HashAlgo::Sha256Cbor => BlockHash::from_slice(&Sha256::digest(bytes)),
            // Canonical (big-endian) byte order, as Python's `xxhash.xxh3_128_digest`.
            HashAlgo::XxhashCbor => {
                BlockHash::from_slice(&xxhash_rust::xxh3::xxh3_128(bytes).to_be_bytes())
            }
        }
    }
}

/// A digest of up to 32 bytes, stored inline so hash chains do not allocate per block.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash {
    len: u8,
    bytes: [u8; 32],
}

impl BlockHash {
    pub fn from_slice(slice: &[u8]) -> Self {
        assert!(slice.len() <= 32, "a BlockHash holds at most 32 bytes");
        let mut bytes = [0u8; 32];
        bytes[..slice.len()].copy_from_slice(slice);
        BlockHash { len: slice.len() as u8, bytes }
    }
}

impl AsRef<[u8]> for BlockHash {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&crate::keys::hex(self.as_ref()))
    }
}

/// A token id type that CBOR-encodes as an integer (unsigned or negative).
pub trait TokenId: Copy + Send + Sync {
    /// The CBOR major type (0 unsigned, 1 negative) and argument of this id.
    fn cbor_head(self) -> (u8, u64);

    #[inline(always)]
    fn write_cbor(self, buf: &mut Vec<u8>) {
        let (major, arg) = self.cbor_head();
        cbor::write_head(buf, major, arg)
    }
}

macro_rules! unsigned_token {
    ($($t:ty),*) => {$(
        impl TokenId for $t {
            #[inline(always)]
            fn cbor_head(self) -> (u8, u64) { (0, self as u64) }
        }
    )*};
}
macro_rules! signed_token {
    ($($t:ty),*) => {$(
        impl TokenId for $t {
            #[inline(always)]
            fn cbor_head(self) -> (u8, u64) {
                if self >= 0 {
                    (0, self as u64)
                } else {
                    (1, (-1 - self as i64) as u64)
                }
            }
        }
    )*};
}
unsigned_token!(u8, u16, u32, u64);
signed_token!(i8, i16, i32, i64);

/// Token ids of one request in one of the widths tokenizers and numpy hand out.
#[derive(Clone, Copy, Debug)]
pub enum TokenSlice<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
    U32(&'a [u32]),
    U64(&'a [u64]),
}

/// Extra keys of one block: None (`f6`) or an array of values.
pub type ExtraKeys = Option<Vec<Value>>;

#[derive(Clone, Debug)]
pub struct BlockHasher {
    algo: HashAlgo,
    none_hash: BlockHash,
}

impl BlockHasher {
    /// `NONE_HASH = HASH(cbor(seed))`, or 32 random bytes without a seed (as vLLM).
    pub fn new(algo: HashAlgo, seed: Option<&str>) -> Result<Self> {
        let none_hash = match seed {
            Some(seed) => algo.digest(&cbor::encode(&Value::Text(seed.to_owned()))),
            None => {
                let mut random = [0u8; 32];
                getrandom::getrandom(&mut random)
                    .map_err(|e| Error::new(format!("no OS randomness for NONE_HASH: {e}")))?;
                BlockHash::from_slice(&random)
            }
        };
        Ok(BlockHasher { algo, none_hash })
    }

    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    pub fn none_hash(&self) -> &[u8] {
        self.none_hash.as_ref()
    }

    /// One hash per full block of `block_size` tokens, chained from `parent` (None: NONE_HASH).
    /// `extra` holds one entry per full block when given.
    pub fn hash_blocks<T: TokenId>(
        &self,
        tokens: &[T],
        block_size: usize,
        parent: Option<&[u8]>,
        extra: Option<&[ExtraKeys]>,
    ) -> Result<Vec<BlockHash>> {
        if block_size == 0 {
            return Err(Error::new("block_size=0: a hash block needs a positive number of tokens"));
        }
        let full_blocks = tokens.len() / block_size;
        if let Some(extra) = extra {
            if extra.len() != full_blocks {
                return Err(Error::new(format!(
                    "extra_keys has {} entries; {} tokens with block_size={} make {} full \
                     block(s): pass one entry (None or a tuple) per full block",
                    extra.len(),
                    tokens.len(),
                    block_size,
                    full_blocks
                )));
            }
        }
        let mut out = Vec::with_capacity(full_blocks);
        let mut parent = match parent {
            Some(p) => BlockHash::from_slice(p),
            None => self.none_hash,
        };
        // One buffer sized for the largest block: 0x83, the parent (head + ≤ 32 bytes), the
        // array head, ≤ 9 bytes per token, then 8 bytes of slack for `put_head`'s word writes
        // and the extra keys (`f6` or grown below for a longer array).
        let mut buf = vec![0u8; 1 + 2 + 32 + 9 + 9 * block_size + 9];
        let mut extra_buf = Vec::new();
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let p = parent.as_ref();
            buf[0] = 0x83;
            let mut pos = cbor::put_head(&mut buf, 1, 2, p.len() as u64);
            buf[pos..pos + p.len()].copy_from_slice(p);
            pos = cbor::put_head(&mut buf, pos + p.len(), 4, block_size as u64);
            for &token in block {
                let (major, arg) = token.cbor_head();
                pos = cbor::put_head(&mut buf, pos, major, arg);
            }
            match extra.and_then(|e| e[i].as_ref()) {
                None => {
                    buf[pos] = 0xf6;
                    pos += 1;
                }
                Some(items) => {
                    extra_buf.clear();
                    cbor::write_head(&mut extra_buf, 4, items.len() as u64);
                    for item in items {
                        cbor::write_value(&mut extra_buf, item);
                    }
                    if buf.len() < pos + extra_buf.len() + 9 {
                        buf.resize(pos + extra_buf.len() + 9, 0);
                    }
                    buf[pos..pos + extra_buf.len()].copy_from_slice(&extra_buf);
                    pos += extra_buf.len();
                }
            }
            parent = self.algo.digest(&buf[..pos]);
            out.push(parent);
        }
        Ok(out)
    }

    /// `hash_blocks` over any supported token width.
    pub fn hash_token_slice(
        &self,
        tokens: TokenSlice<'_>,
        block_size: usize,
        parent: Option<&[u8]>,
        extra: Option<&[ExtraKeys]>,
    ) -> Result<Vec<BlockHash>> {
        match tokens {
            TokenSlice::I32(t) => self.hash_blocks(t, block_size, parent, extra),
            TokenSlice::I64(t) => self.hash_blocks(t, block_size, parent, extra),
            TokenSlice::U32(t) => self.hash_blocks(t, block_size, parent, extra),
            TokenSlice::U64(t) => self.hash_blocks(t, block_size, parent, extra),
        }
    }

    /// `hash_blocks` for many requests, spread over rayon's threads.
    pub fn hash_blocks_batch(
        &self,
        requests: &[TokenSlice<'_>],
        block_size: usize,
        parents: &[Option<&[u8]>],
    ) -> Result<Vec<Vec<BlockHash>>> {
        if !parents.is_empty() && parents.len() != requests.len() {
            return Err(Error::new(format!(
                "parents has {} entries for {} requests: pass one per request or none",
                parents.len(),
                requests.len()
            )));
        }
        requests
            .par_iter()
            .enumerate()
            .map(|(i, tokens)| {
                let parent = parents.get(i).copied().flatten();
                self.hash_token_slice(*tokens, block_size, parent, None)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::hex;

    #[test]
    fn semantics_vector_sha256() {
        let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
        assert_eq!(
            hex(hasher.none_hash()),
            "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
        );
        let tokens: Vec<u32> = (1..=20).collect();
        let h = hasher.hash_blocks(&tokens, 4, None, None).unwrap();
        assert_eq!(h.len(), 5);
        assert_eq!(
            hex(h[0].as_ref()),
            "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb"
        );
        assert_eq!(
            hex(h[4].as_ref()),
            "716b6e9fcf08aac8657a5e3feb26bae26f2dd260fe7fa120981b1b33ba181c89"
        );
    }

    #[test]
    fn semantics_vector_xxhash() {
        let hasher = BlockHasher::new(HashAlgo::XxhashCbor, Some("0")).unwrap();
        assert_eq!(hex(hasher.none_hash()), "1ebe36576dcb573f26b99533a20aaeca");
        let tokens: Vec<i64> = (1..=20).collect();
        let h = hasher.hash_blocks(&tokens, 4, None, None).unwrap();
        assert_eq!(hex(h[0].as_ref()), "0a8577df5ee3430515a8cc1f6e3ac52e");
    }

    #[test]
    fn chaining_continues_from_a_parent() {
        let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("7")).unwrap();
        let tokens: Vec<u32> = (0..64).collect();
        let all = hasher.hash_blocks(&tokens, 16, None, None).unwrap();
        let tail = hasher.hash_blocks(&tokens[32..], 16, Some(all[1].as_ref()), None).unwrap();
        assert_eq!(&all[2..], &tail[..]);
    }

    #[test]
    fn token_types_agree() {
        let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
        let a: Vec<u16> = vec![1, 300, 70];
        let b: Vec<i64> = vec![1, 300, 70];
        assert_eq!(
            hasher.hash_blocks(&a, 3, None, None).unwrap(),
            hasher.hash_blocks(&b, 3, None, None).unwrap()
        );
    }

    #[test]
    fn bad_inputs() {
        let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, None).unwrap();
        assert_eq!(hasher.none_hash().len(), 32);
        assert!(hasher.hash_blocks::<u32>(&[1, 2], 0, None, None).is_err());
        let err = hasher.hash_blocks::<u32>(&[1, 2, 3, 4], 2, None, Some(&[None])).unwrap_err();
        assert!(err.0.contains("2 full"), "{err}");
        assert!(HashAlgo::parse("sha256").is_err());
    }
}
