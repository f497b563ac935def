//! SEMANTICS §1: chained block hashes, byte-identical to vLLM's `sha256_cbor` / `xxhash_cbor`.
//! `h[i] = HASH(cbor([parent, tokens[i·B:(i+1)·B], extra_i]))`.

use crate::cbor::{self, Value};
use crate::error::{Error, Result};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::sync::Mutex;

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
        BlockHash {
            len: slice.len() as u8,
            bytes,
        }
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
    /// The longest CBOR encoding an id of this type can take (head byte + argument bytes).
    const MAX_CBOR_LEN: usize;

    /// The CBOR major type (0 unsigned, 1 negative) and argument of this id.
    fn cbor_head(self) -> (u8, u64);

    /// The id as a u64 when it is in 0 ..= u32::MAX (the common case: a vocabulary index);
    /// anything at or above 2^32 otherwise.
    fn small(self) -> u64;

    #[inline(always)]
    fn write_cbor(self, buf: &mut Vec<u8>) {
        let (major, arg) = self.cbor_head();
        cbor::write_head(buf, major, arg)
    }
}

macro_rules! unsigned_token {
    ($($t:ty),*) => {$(
        impl TokenId for $t {
            const MAX_CBOR_LEN: usize = max_cbor_len(std::mem::size_of::<$t>());
            #[inline(always)]
            fn cbor_head(self) -> (u8, u64) { (0, self as u64) }
            #[inline(always)]
            fn small(self) -> u64 { self as u64 }
        }
    )*};
}
macro_rules! signed_token {
    ($($t:ty),*) => {$(
        impl TokenId for $t {
            const MAX_CBOR_LEN: usize = max_cbor_len(std::mem::size_of::<$t>());
            #[inline(always)]
            fn cbor_head(self) -> (u8, u64) {
                if self >= 0 {
                    (0, self as u64)
                } else {
                    (1, (-1 - self as i64) as u64)
                }
            }
            #[inline(always)]
            fn small(self) -> u64 { self as i64 as u64 }
        }
    )*};
}
/// 1 + the argument bytes of the widest id of a `size`-byte integer type.
const fn max_cbor_len(size: usize) -> usize {
    match size {
        1 => 2,
        2 => 3,
        4 => 5,
        _ => 9,
    }
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

/// `0x83`, a byte-string head of up to 2 bytes and a parent of up to 32 bytes.
const PREFIX_MAX: usize = 1 + 2 + 32;
/// Tokens per chunk of the chain: large enough that the per-chunk lock is noise, small
/// enough that the helper thread and this one rarely wait on each other.
const CHUNK_TOKENS: usize = 2048;
/// The largest slot buffer kept for the next call on a thread (128K int64 ids need ~1.3 MB).
const SCRATCH_KEEP: usize = 16 << 20;

thread_local! {
    /// The slot buffer, reused across calls so large requests do not page-fault a fresh
    /// allocation in every time.
    static SCRATCH: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Bytes past a block's input that its slot keeps free: SHA-256 padding takes 9 to 72.
const PAD_ROOM: usize = 72;

/// SHA-256 of `buf[..len]`, padding the message in place in `buf[len..]` (which must hold the
/// 9 to 72 padding bytes) and running the compression function over it directly: the same
/// digest as `Sha256::digest(&buf[..len])` without copying the message through the hasher's
/// block buffer.
fn sha256_padded_in_place(buf: &mut [u8], len: usize) -> BlockHash {
    use sha2::digest::generic_array::{typenum::U64, GenericArray};
    const IV: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let padded = (len + 9).div_ceil(64) * 64;
    let buf = &mut buf[..padded];
    buf[len] = 0x80;
    buf[len + 1..padded - 8].fill(0);
    buf[padded - 8..].copy_from_slice(&((len as u64) * 8).to_be_bytes());
    // SAFETY: GenericArray<u8, U64> is a [u8; 64] (size 64, align 1) and `buf` is
    // `padded / 64` of them.
    let blocks: &[GenericArray<u8, U64>] =
        unsafe { std::slice::from_raw_parts(buf.as_ptr().cast(), padded / 64) };
    let mut state = IV;
    sha2::compress256(&mut state, blocks);
    let mut out = [0u8; 32];
    for (bytes, word) in out.chunks_exact_mut(4).zip(state) {
        bytes.copy_from_slice(&word.to_be_bytes());
    }
    BlockHash::from_slice(&out)
}

/// A run of consecutive blocks' slots. `ends` is empty until the chunk is encoded, then holds
/// each block's end offset in `buf`.
struct Chunk<'a> {
    buf: &'a mut [u8],
    first: usize,
    last: usize,
    ends: Vec<usize>,
}

struct EncodeCtx<'a, T> {
    tokens: &'a [T],
    block_size: usize,
    slot_starts: &'a [usize],
    extra_cbor: Option<&'a [Vec<u8>]>,
}

impl<T: TokenId> EncodeCtx<'_, T> {
    /// Writes the array head, ids and extra keys of each block of `chunk` into its slot.
    fn encode(&self, chunk: &mut Chunk<'_>) {
        let base = self.slot_starts[chunk.first];
        let mut ends = Vec::with_capacity(chunk.last - chunk.first);
        for i in chunk.first..chunk.last {
            let start = self.slot_starts[i] - base + PREFIX_MAX;
            let block = &self.tokens[i * self.block_size..(i + 1) * self.block_size];
            let extra: &[u8] = match self.extra_cbor {
                Some(e) => &e[i],
                None => &[0xf6],
            };
            // The slot was sized for this: 9 + MAX_CBOR_LEN per id + extra + 8 of slack.
            let room =
                &mut chunk.buf[start..start + 9 + T::MAX_CBOR_LEN * block.len() + extra.len() + 8];
            let mut pos = cbor::put_head(room, 0, 4, block.len() as u64);
            // SAFETY: `room` holds 9 + MAX_CBOR_LEN bytes per id + 8 past `pos`.
            pos += unsafe { encode_ids(room.as_mut_ptr().add(pos), block) };
            room[pos..pos + extra.len()].copy_from_slice(extra);
            ends.push(start + pos + extra.len());
        }
        chunk.ends = ends;
    }
}

/// Writes the CBOR of each id of `block` from `dst`, returning the bytes written.
///
/// # Safety
/// `dst` must be valid for writes of `T::MAX_CBOR_LEN * block.len() + 8` bytes.
#[inline]
unsafe fn encode_ids<T: TokenId>(dst: *mut u8, block: &[T]) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            return encode_ids_avx2(dst, block);
        }
    }
    encode_ids_generic(dst, block)
}

/// `encode_ids_generic` with the 8-id groups done in AVX2 (any x86-64 since 2013; checked at
/// run time). Per 4 ids: three byte shuffles build the 2-, 3- and 5-byte encodings, three
/// compares pick the size class, three blends select the word and two subtractions give the
/// length; the words are then stored one after the other (a load, a store and an add per id).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn encode_ids_avx2<T: TokenId>(dst: *mut u8, block: &[T]) -> usize {
    use std::arch::x86_64::*;
    const Z: i8 = -128; // pshufb: zero this byte
    #[rustfmt::skip]
    let sh1 = _mm256_setr_epi8(
        Z, 0, Z, Z, Z, Z, Z, Z, Z, 8, Z, Z, Z, Z, Z, Z,
        Z, 0, Z, Z, Z, Z, Z, Z, Z, 8, Z, Z, Z, Z, Z, Z,
    );
    #[rustfmt::skip]
    let sh2 = _mm256_setr_epi8(
        Z, 1, 0, Z, Z, Z, Z, Z, Z, 9, 8, Z, Z, Z, Z, Z,
        Z, 1, 0, Z, Z, Z, Z, Z, Z, 9, 8, Z, Z, Z, Z, Z,
    );
    #[rustfmt::skip]
    let sh4 = _mm256_setr_epi8(
        Z, 3, 2, 1, 0, Z, Z, Z, Z, 11, 10, 9, 8, Z, Z, Z,
        Z, 3, 2, 1, 0, Z, Z, Z, Z, 11, 10, 9, 8, Z, Z, Z,
    );
    let (i1, i2, i4) = (
        _mm256_set1_epi64x(24),
        _mm256_set1_epi64x(25),
        _mm256_set1_epi64x(26),
    );
    let (t1, t2, t4) = (
        _mm256_set1_epi64x(23),
        _mm256_set1_epi64x(0xff),
        _mm256_set1_epi64x(0xffff),
    );
    let one = _mm256_set1_epi64x(1);

    let mut pos = 0usize;
    let mut groups = block.chunks_exact(8);
    for group in &mut groups {
        let mut v = [0u64; 8];
        let mut high = 0u64;
        for k in 0..8 {
            v[k] = group[k].small();
            high |= v[k];
        }
        if high >> 32 != 0 {
            for &token in group {
                let (major, arg) = token.cbor_head();
                pos += cbor::put_head_unchecked(dst.add(pos), major, arg);
            }
            continue;
        }
        let mut words = [0u64; 8];
        let mut lens = [0u64; 8];
        for half in 0..2 {
            let x = _mm256_loadu_si256(v.as_ptr().add(4 * half).cast());
            // Every lane is below 2^32, so the signed 64-bit compares are exact.
            let c1 = _mm256_cmpgt_epi64(x, t1);
            let c2 = _mm256_cmpgt_epi64(x, t2);
            let c4 = _mm256_cmpgt_epi64(x, t4);
            let w1 = _mm256_or_si256(_mm256_shuffle_epi8(x, sh1), i1);
            let w2 = _mm256_or_si256(_mm256_shuffle_epi8(x, sh2), i2);
            let w4 = _mm256_or_si256(_mm256_shuffle_epi8(x, sh4), i4);
            let w = _mm256_blendv_epi8(
                _mm256_blendv_epi8(_mm256_blendv_epi8(x, w1, c1), w2, c2),
                w4,
                c4,
            );
            // 1 + [>= 24] + [>= 256] + 2·[>= 65536], the masks being -1 where true.
            let n = _mm256_sub_epi64(
                _mm256_sub_epi64(_mm256_sub_epi64(one, c1), c2),
                _mm256_add_epi64(c4, c4),
            );
            _mm256_storeu_si256(words.as_mut_ptr().add(4 * half).cast(), w);
            _mm256_storeu_si256(lens.as_mut_ptr().add(4 * half).cast(), n);
        }
        for k in 0..8 {
            dst.add(pos)
                .cast::<[u8; 8]>()
                .write_unaligned(words[k].to_le_bytes());
            pos += lens[k] as usize;
        }
    }
    for &token in groups.remainder() {
        let (major, arg) = token.cbor_head();
        pos += cbor::put_head_unchecked(dst.add(pos), major, arg);
    }
    pos
}

/// The id loop without SIMD: `put_head_unchecked` per id.
#[inline(always)]
unsafe fn encode_ids_generic<T: TokenId>(dst: *mut u8, block: &[T]) -> usize {
    let mut pos = 0usize;
    for &token in block {
        let (major, arg) = token.cbor_head();
        pos += cbor::put_head_unchecked(dst.add(pos), major, arg);
    }
    pos
}

/// One block's extra keys: `f6`, or an array of values.
fn encode_extra(extra: &ExtraKeys) -> Vec<u8> {
    match extra {
        None => vec![0xf6],
        Some(items) => {
            let mut buf = Vec::new();
            cbor::write_head(&mut buf, 4, items.len() as u64);
            for item in items {
                cbor::write_value(&mut buf, item);
            }
            buf
        }
    }
}

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
            return Err(Error::new(
                "block_size=0: a hash block needs a positive number of tokens",
            ));
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
        let parent = match parent {
            Some(p) => BlockHash::from_slice(p),
            None => self.none_hash,
        };
        // The extra keys of each block, encoded once up front (None when every block has none:
        // then each block ends in `f6`).
        let extra_cbor: Option<Vec<Vec<u8>>> = extra
            .filter(|e| e.iter().any(Option::is_some))
            .map(|e| e.iter().map(encode_extra).collect());
        Ok(self.chain(tokens, block_size, parent, extra_cbor.as_deref()))
    }

    /// The chain proper. Only the first 35 bytes of a block's input (`0x83`, the parent's
    /// head and bytes) depend on the previous hash; the rest (array head, token ids, extra
    /// keys) is encoded into a slot of one buffer, 35 bytes after the slot's start, ahead of
    /// time. The slots are split into chunks of ~2K tokens; this thread walks the chunks in
    /// order (encoding a chunk itself when it is not done yet, then writing each parent
    /// right-aligned before its token part and hashing the contiguous slice), while one
    /// rayon helper encodes chunks from the back until the two meet. A chunk's mutex is held
    /// by whichever thread works on it, so at most one chunk is ever waited for, and a helper
    /// that starts late (or never gets a core) only costs this thread the encoding it does
    /// itself.
    fn chain<T: TokenId>(
        &self,
        tokens: &[T],
        block_size: usize,
        mut parent: BlockHash,
        extra_cbor: Option<&[Vec<u8>]>,
    ) -> Vec<BlockHash> {
        let full_blocks = tokens.len() / block_size;
        let mut out = Vec::with_capacity(full_blocks);
        if full_blocks == 0 {
            return out;
        }
        // Slot i: PREFIX_MAX bytes for the parent prefix, then the array head (<= 9), the ids
        // (<= MAX_CBOR_LEN each), the extra keys (`f6` or their encoding) and PAD_ROOM bytes
        // for `put_head_unchecked`'s word writes and the SHA-256 padding.
        let fixed = PREFIX_MAX + 9 + T::MAX_CBOR_LEN * block_size + PAD_ROOM;
        let slot_starts: Vec<usize> = {
            let mut starts = Vec::with_capacity(full_blocks + 1);
            let mut at = 0;
            starts.push(0);
            for i in 0..full_blocks {
                at += fixed + extra_cbor.map_or(1, |e| e[i].len());
                starts.push(at);
            }
            starts
        };
        let blocks_per_chunk = (CHUNK_TOKENS / block_size).max(1);
        let num_chunks = full_blocks.div_ceil(blocks_per_chunk);

        SCRATCH.with(|cell| {
            let mut buffer = cell.take();
            let total = slot_starts[full_blocks];
            if buffer.len() < total {
                buffer.resize(total, 0);
            }
            let chunks: Vec<Mutex<Chunk<'_>>> = {
                let mut rest = &mut buffer[..total];
                (0..num_chunks)
                    .map(|c| {
                        let first = c * blocks_per_chunk;
                        let last = (first + blocks_per_chunk).min(full_blocks);
                        let (mine, tail) = std::mem::take(&mut rest)
                            .split_at_mut(slot_starts[last] - slot_starts[first]);
                        rest = tail;
                        Mutex::new(Chunk {
                            buf: mine,
                            first,
                            last,
                            ends: Vec::new(),
                        })
                    })
                    .collect()
            };
            let ctx = EncodeCtx {
                tokens,
                block_size,
                slot_starts: &slot_starts,
                extra_cbor,
            };
            let lock = |c: usize| chunks[c].lock().unwrap_or_else(|e| e.into_inner());

            let mut hash_all = |out: &mut Vec<BlockHash>| {
                for c in 0..num_chunks {
                    let mut chunk = lock(c);
                    if chunk.ends.is_empty() {
                        ctx.encode(&mut chunk);
                    }
                    let base = slot_starts[chunk.first];
                    for i in chunk.first..chunk.last {
                        let body = slot_starts[i] - base + PREFIX_MAX;
                        let p = parent.as_ref();
                        let start = body - 1 - cbor::head_len(p.len() as u64) - p.len();
                        chunk.buf[start] = 0x83;
                        let at = cbor::put_head(chunk.buf, start + 1, 2, p.len() as u64);
                        chunk.buf[at..body].copy_from_slice(p);
                        let end = chunk.ends[i - chunk.first];
                        parent = match self.algo {
                            // The slot has PAD_ROOM bytes past `end`.
                            HashAlgo::Sha256Cbor => sha256_padded_in_place(
                                &mut chunk.buf[start..end + PAD_ROOM],
                                end - start,
                            ),
                            HashAlgo::XxhashCbor => self.algo.digest(&chunk.buf[start..end]),
                        };
                        out.push(parent);
                    }
                }
            };
            if num_chunks < 3 {
                hash_all(&mut out);
            } else {
                rayon::in_place_scope(|scope| {
                    scope.spawn(|_| {
                        for c in (0..num_chunks).rev() {
                            let Ok(mut chunk) = chunks[c].try_lock() else {
                                break;
                            };
                            if !chunk.ends.is_empty() {
                                break;
                            }
                            ctx.encode(&mut chunk);
                        }
                    });
                    hash_all(&mut out);
                });
            }
            drop(chunks);
            if buffer.len() <= SCRATCH_KEEP {
                cell.replace(buffer);
            }
        });
        out
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
        let tail = hasher
            .hash_blocks(&tokens[32..], 16, Some(all[1].as_ref()), None)
            .unwrap();
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

    /// The chunked, helper-encoded chain against a per-block `cbor::encode` of the Value tree,
    /// over ids of every head size (negative and >= 2^32 included), block sizes that are not
    /// a multiple of 8, many chunks and some blocks with extra keys.
    #[test]
    fn chain_matches_reference_encoding() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let tokens: Vec<i64> = (0..20_000)
            .map(|i| {
                let r = next();
                match i % 97 {
                    0 => -((r % 1000) as i64) - 1,
                    1 => (r >> 1) as i64,
                    2 => (r % 24) as i64,
                    3 => (r % 256) as i64,
                    _ => (r % 152_064) as i64,
                }
            })
            .collect();
        for algo in [HashAlgo::Sha256Cbor, HashAlgo::XxhashCbor] {
            let hasher = BlockHasher::new(algo, Some("3")).unwrap();
            for block_size in [1usize, 7, 16, 64, 300] {
                let blocks = tokens.len() / block_size;
                let extra: Vec<ExtraKeys> = (0..blocks)
                    .map(|i| {
                        (i % 5 == 2)
                            .then(|| vec![Value::Text(format!("lora{i}")), Value::Int(i as i128)])
                    })
                    .collect();
                for extra in [None, Some(&extra[..])] {
                    let got = hasher
                        .hash_blocks(&tokens, block_size, None, extra)
                        .unwrap();
                    let mut parent = hasher.none_hash;
                    for (i, block) in tokens.chunks_exact(block_size).enumerate() {
                        let value = Value::Array(vec![
                            Value::Bytes(parent.as_ref().to_vec()),
                            Value::Array(block.iter().map(|&t| Value::Int(t as i128)).collect()),
                            match extra.and_then(|e| e[i].clone()) {
                                None => Value::Null,
                                Some(items) => Value::Array(items),
                            },
                        ]);
                        parent = algo.digest(&cbor::encode(&value));
                        assert_eq!(got[i], parent, "{algo:?} block_size {block_size} block {i}");
                    }
                    assert_eq!(got.len(), blocks);
                }
            }
            // u32 ids and a short custom parent take the same path.
            let small: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
            let wide: Vec<u64> = small.iter().map(|&t| t as u64).collect();
            let p = [7u8; 5];
            assert_eq!(
                hasher.hash_blocks(&small, 64, Some(&p), None).unwrap(),
                hasher.hash_blocks(&wide, 64, Some(&p), None).unwrap()
            );
        }
    }

    #[test]
    fn bad_inputs() {
        let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, None).unwrap();
        assert_eq!(hasher.none_hash().len(), 32);
        assert!(hasher.hash_blocks::<u32>(&[1, 2], 0, None, None).is_err());
        let err = hasher
            .hash_blocks::<u32>(&[1, 2, 3, 4], 2, None, Some(&[None]))
            .unwrap_err();
        assert!(err.0.contains("2 full"), "{err}");
        assert!(HashAlgo::parse("sha256").is_err());
    }
}
