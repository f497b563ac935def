//! Raw byte regions for kvstride's own copies: between the KV cache and an arena slot
//! (`kvstride.arena`), or a staging buffer (`kvstride.transfer`). One copy per block piece,
//! fused with the XXH3-64 of the block's bytes (computed while they are in cache on a save,
//! checked before any byte moves on a load). The caller computes the addresses from tensors it
//! keeps alive; the work is spread over rayon's threads once a batch is large enough to pay for
//! it, and written with non-temporal stores once it is far larger than the cache.

use std::hash::Hasher as _;

use rayon::prelude::*;
use twox_hash::XxHash3_64;

/// Below this many bytes in a batch one thread does all of it (thread wake-ups cost more).
pub const PARALLEL_BYTES: u64 = 1 << 20;

/// From this many bytes in a batch (well past a last-level cache) rows are written with
/// non-temporal stores: a plain store first reads every destination line it overwrites, a third
/// memory pass that glibc's `memcpy` (torch's `copy_`) also skips for copies this large, while
/// the 64 KiB pieces of a block are far below the size where `memcpy` would itself.
pub const STREAM_BYTES: u64 = 16 << 20;

/// Copy `n` bytes without reading the destination into the cache (non-temporal stores; the
/// caller fences). Falls back to `copy_nonoverlapping` off x86-64.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`.
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        // SAFETY: the caller's contract; SSE2 is part of x86-64; stores go to 16-byte aligned
        // addresses inside the destination, the unaligned head and tail are copied plainly.
        unsafe {
            let head = dst.align_offset(16).min(n);
            std::ptr::copy_nonoverlapping(src, dst, head);
            let mut i = head;
            while i + 64 <= n {
                let s = src.add(i) as *const __m128i;
                let (a, b, c, d) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)), _mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
                let t = dst.add(i) as *mut __m128i;
                _mm_stream_si128(t, a);
                _mm_stream_si128(t.add(1), b);
                _mm_stream_si128(t.add(2), c);
                _mm_stream_si128(t.add(3), d);
                i += 64;
            }
            std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, n)
    }
}

/// Order this thread's non-temporal stores before anything it does next (the batch's
/// completion, seen by other threads).
fn fence_streaming() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
}

/// Copy `len[i]` bytes from address `src[i]` to address `dst[i]`, for every `i`.
///
/// # Safety
/// Every source region must be readable and every destination region writable for its
/// length during the call, and no destination may overlap any other region of the batch.
pub unsafe fn copy_regions(src: &[u64], dst: &[u64], len: &[u64]) {
    let copy = |i: usize| {
        // SAFETY: the caller's contract above.
        unsafe { std::ptr::copy_nonoverlapping(src[i] as *const u8, dst[i] as *mut u8, len[i] as usize) }
    };
    if len.len() > 1 && len.iter().sum::<u64>() >= PARALLEL_BYTES {
        (0..len.len()).into_par_iter().for_each(copy);
    } else {
        (0..len.len()).for_each(copy);
    }
}

/// XXH3-64 (seed 0) of each region `addr[i]`, `len[i]`.
///
/// # Safety
/// Every region must be readable for its length during the call.
pub unsafe fn xxh3_regions(addr: &[u64], len: &[u64]) -> Vec<u64> {
    let hash = |i: usize| {
        // SAFETY: the caller's contract above.
        let bytes = unsafe { std::slice::from_raw_parts(addr[i] as *const u8, len[i] as usize) };
        XxHash3_64::oneshot(bytes)
    };
    let total: u64 = len.iter().sum();
    if total >= PARALLEL_BYTES && len.len() > 1 {
        (0..len.len()).into_par_iter().with_max_len(1).map(hash).collect()
    } else {
        (0..len.len()).map(hash).collect()
    }
}

/// Region arrays of one batch must have the same length (one entry per region).
pub fn check_same_lengths(arrays: &[&[u64]]) -> crate::Result<()> {
    if arrays.windows(2).any(|w| w[0].len() != w[1].len()) {
        return Err(crate::Error::new("region arrays must have the same length"));
    }
    Ok(())
}

/// One part of a store value: the address and length of bytes the caller keeps alive.
pub type Part = (usize, usize);

/// The digest of one value given as parts (their bytes in order): its XXH3-64 (seed 0), or with
/// a secret its keyed payload tag (`Secret::payload_tag`). Empty parts are skipped (their
/// address is never read).
///
/// # Safety
/// Every non-empty part must be readable at its address for its length during the call.
pub unsafe fn value_digest(parts: &[Part], secret: Option<&crate::secret::Secret>) -> u64 {
    let slices: Vec<&[u8]> = parts
        .iter()
        .filter(|p| p.1 > 0)
        // SAFETY: the caller's contract above.
        .map(|&(addr, len)| unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
        .collect();
    match secret {
        Some(secret) => secret.payload_tag(&slices),
        None => crate::payload::xxh3_64_parts(&slices),
    }
}

/// [`value_digest`] of each value, spread over rayon's threads (one value per task) once the
/// batch holds [`PARALLEL_BYTES`] or more.
///
/// # Safety
/// As [`value_digest`], for every value.
pub unsafe fn value_digests(values: &[Vec<Part>], secret: Option<&crate::secret::Secret>) -> Vec<u64> {
    let total: u64 = values.iter().flatten().map(|p| p.1 as u64).sum();
    // SAFETY: the caller's contract above.
    let one = |parts: &Vec<Part>| unsafe { value_digest(parts, secret) };
    if total >= PARALLEL_BYTES && values.len() > 1 {
        values.par_iter().with_max_len(1).map(one).collect()
    } else {
        values.iter().map(one).collect()
    }
}

/// Rows of a batch: row `r` is the regions `row_start[r]..row_start[r + 1]`, copied from
/// `src` to `dst`; its value (whose digest is kept or checked) is the bytes of those regions
/// in order: what a store holds for one block, wherever its pieces lie.
pub struct Rows<'a> {
    pub src: &'a [u64],
    pub dst: &'a [u64],
    pub len: &'a [u64],
    pub row_start: &'a [u64],
    /// With a deployment secret, each row's digest is its keyed payload tag
    /// (`Secret::payload_tag`) instead of its XXH3-64.
    pub secret: Option<&'a crate::secret::Secret>,
}

impl Rows<'_> {
    /// The batch's shape: one `src`, `dst` and `len` entry per region, and `row_start` running
    /// from 0 to the number of regions without going back (one more entry than rows).
    pub fn check(&self) -> crate::Result<()> {
        check_same_lengths(&[self.src, self.dst, self.len])?;
        let n = self.len.len() as u64;
        let starts_ok = self.row_start.first() == Some(&0)
            && self.row_start.last() == Some(&n)
            && self.row_start.windows(2).all(|w| w[0] <= w[1]);
        if !starts_ok {
            return Err(crate::Error::new(
                "row_start must run from 0 to the number of regions, one more entry than rows",
            ));
        }
        Ok(())
    }

    /// A load's `expected` digests: one per row.
    pub fn check_expected(&self, expected: &[u64]) -> crate::Result<()> {
        if expected.len() + 1 != self.row_start.len() {
            return Err(crate::Error::new("expected needs one digest per row"));
        }
        Ok(())
    }

    fn rows(&self) -> usize {
        self.row_start.len().saturating_sub(1)
    }

    fn regions(&self, r: usize) -> std::ops::Range<usize> {
        self.row_start[r] as usize..self.row_start[r + 1] as usize
    }

    /// # Safety
    /// Region `i` must be readable at `addr[i]` for `len[i]` bytes.
    unsafe fn bytes<'b>(&self, addr: &'b [u64], i: usize) -> &'b [u8] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(addr[i] as *const u8, self.len[i] as usize) }
    }

    /// XXH3-64 of row `r`'s bytes at `addr` (its regions in order): one pass when they are
    /// back to back (an arena slot), streamed otherwise (staged pieces).
    ///
    /// # Safety
    /// Every region of row `r` must be readable at `addr`.
    unsafe fn digest(&self, addr: &[u64], r: usize) -> u64 {
        let regions = self.regions(r);
        if let Some(secret) = self.secret {
            let mut mac = secret.payload_hasher();
            for i in regions {
                // SAFETY: the caller's contract.
                mac.update(unsafe { self.bytes(addr, i) });
            }
            return crate::secret::Secret::payload_tag_of(mac);
        }
        let contiguous = regions.clone().skip(1).all(|i| addr[i] == addr[i - 1] + self.len[i - 1]);
        if contiguous && !regions.is_empty() {
            let total: u64 = self.len[regions.clone()].iter().sum();
            // SAFETY: the regions are readable and back to back.
            return XxHash3_64::oneshot(unsafe { std::slice::from_raw_parts(addr[regions.start] as *const u8, total as usize) });
        }
        let mut hasher = XxHash3_64::with_seed(0);
        for i in regions {
            // SAFETY: the caller's contract.
            hasher.write(unsafe { self.bytes(addr, i) });
        }
        hasher.finish()
    }

    fn parallel(&self) -> bool {
        self.rows() > 1 && self.len.iter().sum::<u64>() >= PARALLEL_BYTES
    }

    fn streaming(&self) -> bool {
        self.len.iter().sum::<u64>() >= STREAM_BYTES
    }

    /// # Safety
    /// Row `r`'s sources readable, destinations writable, none overlapping.
    unsafe fn copy_row(&self, r: usize, streaming: bool) {
        for i in self.regions(r) {
            let (s, d, n) = (self.src[i] as *const u8, self.dst[i] as *mut u8, self.len[i] as usize);
            // SAFETY: the caller's contract.
            unsafe {
                if streaming {
                    copy_streaming(s, d, n)
                } else {
                    std::ptr::copy_nonoverlapping(s, d, n)
                }
            }
        }
        if streaming {
            fence_streaming();
        }
    }

    fn each<T: Send>(&self, one: impl Fn(usize) -> T + Sync + Send) -> Vec<T> {
        if self.parallel() {
            (0..self.rows()).into_par_iter().with_max_len(1).map(one).collect()
        } else {
            (0..self.rows()).map(one).collect()
        }
    }
}

/// Save: copy each row's regions and return the XXH3-64 of the row's value, hashed at the
/// destination right after the row's copy, while it is still in cache.
///
/// # Safety
/// Every source region readable and every destination writable for its length during the
/// call, no destination overlapping any other region of the batch.
pub unsafe fn save_rows(rows: &Rows<'_>) -> Vec<u64> {
    let streaming = rows.streaming();
    rows.each(|r| {
        // SAFETY: the caller's contract. The digest is of the same bytes either way: the
        // destination when plain stores left it in cache, else the source the copy just read.
        unsafe {
            rows.copy_row(r, streaming);
            rows.digest(if streaming { rows.src } else { rows.dst }, r)
        }
    })
}

/// Load: hash each row's value at its source and copy the row only when the digest is
/// `expected[r]`. Returns which rows were copied.
///
/// # Safety
/// As `save_rows`.
pub unsafe fn load_rows(rows: &Rows<'_>, expected: &[u64]) -> Vec<bool> {
    let streaming = rows.streaming();
    rows.each(|r| {
        // SAFETY: the caller's contract.
        let ok = unsafe { rows.digest(rows.src, r) } == expected[r];
        if ok {
            // SAFETY: the caller's contract.
            unsafe { rows.copy_row(r, streaming) }
        }
        ok
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_region_and_nothing_else() {
        let src: Vec<u8> = (0..=255).collect();
        let mut dst = vec![0u8; 256];
        let (s, d) = (src.as_ptr() as u64, dst.as_mut_ptr() as u64);
        unsafe { copy_regions(&[s + 10, s + 100], &[d, d + 200], &[5, 3]) };
        assert_eq!(&dst[..5], &src[10..15]);
        assert_eq!(&dst[200..203], &src[100..103]);
        assert!(dst[5..200].iter().all(|&b| b == 0) && dst[203..].iter().all(|&b| b == 0));
    }

    #[test]
    fn digests_match_xxh3_of_each_region() {
        let data: Vec<u8> = (0..(3usize << 20)).map(|i| (i % 253) as u8).collect();
        let base = data.as_ptr() as u64;
        let addr = [base, base + 17, base + (1 << 20)];
        let len = [0u64, 1000, 2 << 20];
        let got = unsafe { xxh3_regions(&addr, &len) };
        let want: Vec<u64> = addr
            .iter()
            .zip(len)
            .map(|(&a, l)| xxhash_rust::xxh3::xxh3_64(&data[(a - base) as usize..][..l as usize]))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn rows_save_digest_and_load_only_what_matches() {
        let kv: Vec<u8> = (0..64u32).map(|i| i as u8).collect();
        let mut slots = vec![0u8; 64];
        let mut out = vec![0u8; 64];
        let (k, s, o) = (kv.as_ptr() as u64, slots.as_mut_ptr() as u64, out.as_mut_ptr() as u64);
        // Two rows of two pieces: kv[0..4] + kv[8..12] -> slot 0, kv[16..20] + kv[24..28] -> slot 1.
        let save = Rows { src: &[k, k + 8, k + 16, k + 24], dst: &[s, s + 4, s + 32, s + 36], len: &[4; 4], row_start: &[0, 2, 4], secret: None };
        let digests = unsafe { save_rows(&save) };
        assert_eq!(digests[0], xxhash_rust::xxh3::xxh3_64(&[0, 1, 2, 3, 8, 9, 10, 11]));
        assert_eq!(digests[1], xxhash_rust::xxh3::xxh3_64(&[16, 17, 18, 19, 24, 25, 26, 27]));
        slots[33] ^= 1; // slot 1 corrupted
        let load = Rows { src: save.dst, dst: &[o, o + 4, o + 32, o + 36], ..save };
        let ok = unsafe { load_rows(&load, &digests) };
        assert_eq!(ok, vec![true, false]);
        assert_eq!(&out[..8], &[0, 1, 2, 3, 8, 9, 10, 11]);
        assert!(out[32..40].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_row_digest_is_the_one_shot_xxh3_of_its_pieces_in_order() {
        // Pieces larger than XXH3's internal buffer, of odd sizes, scattered: the streamed
        // digest must equal the one-shot digest of the concatenation (what a store checks).
        let data: Vec<u8> = (0..(3usize << 20)).map(|i| (i * 7 % 251) as u8).collect();
        let mut copy = vec![0u8; 3 << 20];
        let (d, c) = (data.as_ptr() as u64, copy.as_mut_ptr() as u64);
        let len = [70_001u64, 1, 1 << 20, 333];
        let src = [d + (2 << 20), d + 5, d, d + 1_500_000];
        let dst = [c, c + 70_001, c + 70_002, c + 70_002 + (1 << 20)];
        let rows = Rows { src: &src, dst: &dst, len: &len, row_start: &[0, 4], secret: None };
        let digest = unsafe { save_rows(&rows) }[0];
        let total: usize = len.iter().sum::<u64>() as usize;
        assert_eq!(digest, xxhash_rust::xxh3::xxh3_64(&copy[..total]));
        let whole: Vec<u8> = src.iter().zip(len).flat_map(|(&a, l)| data[(a - d) as usize..][..l as usize].to_vec()).collect();
        assert_eq!(&copy[..total], &whole[..]);
    }

    #[test]
    fn streaming_copies_match_plain_ones_at_any_alignment() {
        let src: Vec<u8> = (0..10_000u32).map(|i| (i * 13 % 256) as u8).collect();
        for (from, to, n) in [(0, 0, 0), (1, 3, 15), (0, 0, 64), (5, 7, 999), (16, 1, 4096), (3, 0, 9000)] {
            let mut dst = vec![0u8; 10_000];
            unsafe { copy_streaming(src.as_ptr().add(from), dst.as_mut_ptr().add(to), n) };
            fence_streaming();
            assert_eq!(&dst[to..to + n], &src[from..from + n], "{from} {to} {n}");
            assert!(dst[..to].iter().all(|&b| b == 0) && dst[to + n..].iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn rows_past_the_streaming_size_save_and_load_the_same_bytes() {
        // 20 rows of 2 pieces, 1 MiB in all per row: past STREAM_BYTES, so both directions
        // use non-temporal stores and the save hashes the source.
        let (rows_n, piece) = (20usize, 512usize << 10);
        let kv: Vec<u8> = (0..rows_n * 2 * piece + 8).map(|i| (i * 7 % 253) as u8).collect();
        let mut slots = vec![0u8; rows_n * 2 * piece];
        let mut out = vec![0u8; rows_n * 2 * piece + 8];
        let (k, s, o) = (kv.as_ptr() as u64 + 3, slots.as_mut_ptr() as u64, out.as_mut_ptr() as u64 + 5);
        let src: Vec<u64> = (0..2 * rows_n as u64).map(|i| k + i * piece as u64).collect();
        let dst: Vec<u64> = (0..2 * rows_n as u64).map(|i| s + i * piece as u64).collect();
        let back: Vec<u64> = (0..2 * rows_n as u64).map(|i| o + i * piece as u64).collect();
        let len = vec![piece as u64; 2 * rows_n];
        let starts: Vec<u64> = (0..=rows_n as u64).map(|r| 2 * r).collect();
        let save = Rows { src: &src, dst: &dst, len: &len, row_start: &starts, secret: None };
        assert!(save.streaming());
        let digests = unsafe { save_rows(&save) };
        for r in 0..rows_n {
            assert_eq!(digests[r], xxhash_rust::xxh3::xxh3_64(&slots[r * 2 * piece..(r + 1) * 2 * piece]));
        }
        assert_eq!(&slots[..], &kv[3..3 + rows_n * 2 * piece]);
        let load = Rows { src: &dst, dst: &back, len: &len, row_start: &starts, secret: None };
        let ok = unsafe { load_rows(&load, &digests) };
        assert!(ok.iter().all(|&x| x));
        assert_eq!(&out[5..5 + rows_n * 2 * piece], &slots[..]);
    }

    #[test]
    fn batch_shapes_are_checked() {
        let rows = |len: &'static [u64], row_start: &'static [u64]| Rows { src: &[1, 2], dst: &[3, 4], len, row_start, secret: None };
        assert_eq!(rows(&[1, 1], &[0, 1, 2]).check(), Ok(()));
        assert_eq!(rows(&[1, 1], &[0, 2]).check(), Ok(()));
        assert_eq!(rows(&[1, 1], &[0, 0, 2]).check(), Ok(()), "an empty row");
        assert_eq!(rows(&[1], &[0, 1]).check().unwrap_err().0, "region arrays must have the same length");
        let starts = "row_start must run from 0 to the number of regions, one more entry than rows";
        for bad in [&[][..], &[0], &[1, 2], &[0, 1], &[0, 2, 1, 2], &[0, 3]] {
            assert_eq!(rows(&[1, 1], bad).check().unwrap_err().0, starts, "{bad:?}");
        }
        let ok = rows(&[1, 1], &[0, 1, 2]);
        assert_eq!(ok.check_expected(&[5, 6]), Ok(()));
        assert_eq!(ok.check_expected(&[5]).unwrap_err().0, "expected needs one digest per row");
        assert_eq!(check_same_lengths(&[&[1], &[2]]), Ok(()));
        assert!(check_same_lengths(&[&[1], &[2, 3]]).is_err());
    }

    #[test]
    fn value_digests_hash_each_value_s_parts_in_order() {
        let secret = crate::secret::Secret::new(&[6u8; 32]).unwrap();
        let data: Vec<u8> = (0..(3usize << 20)).map(|i| (i * 11 % 251) as u8).collect();
        let at = |from: usize, len: usize| -> Part { (data.as_ptr() as usize + from, len) };
        // An empty part at a null address is never read.
        let small = vec![vec![at(5, 100), (0, 0), at(1000, 7)], vec![], vec![at(0, 1)]];
        let big = vec![vec![at(0, 1 << 20), at(2 << 20, 1 << 20)], vec![at(17, 999_999)]];
        for values in [&small, &big] {
            let concat: Vec<Vec<u8>> = values
                .iter()
                .map(|v| v.iter().filter(|p| p.1 > 0).flat_map(|&(a, n)| data[a - data.as_ptr() as usize..][..n].to_vec()).collect())
                .collect();
            let want: Vec<u64> = concat.iter().map(|c| xxhash_rust::xxh3::xxh3_64(c)).collect();
            assert_eq!(unsafe { value_digests(values, None) }, want);
            let tags: Vec<u64> = concat.iter().map(|c| secret.payload_tag(&[c])).collect();
            assert_eq!(unsafe { value_digests(values, Some(&secret)) }, tags);
            assert_eq!(unsafe { value_digest(&values[0], None) }, want[0]);
        }
    }

    #[test]
    fn keyed_rows_carry_the_payload_tag_and_refuse_a_wrong_one() {
        let secret = crate::secret::Secret::new(&[3u8; 32]).unwrap();
        let src: Vec<u8> = (0..64).collect();
        let mut dst = vec![0u8; 64];
        let (k, s) = (src.as_ptr() as u64, dst.as_mut_ptr() as u64);
        let save = Rows { src: &[k, k + 32], dst: &[s, s + 8], len: &[8, 8], row_start: &[0, 2], secret: Some(&secret) };
        let tags = unsafe { save_rows(&save) };
        let mut want = src[..8].to_vec();
        want.extend_from_slice(&src[32..40]);
        assert_eq!(tags[0], secret.payload_tag(&[&want]));
        let mut back = vec![0u8; 16];
        let b = back.as_mut_ptr() as u64;
        let load = Rows { src: &[s, s + 8], dst: &[b, b + 8], len: &[8, 8], row_start: &[0, 2], secret: Some(&secret) };
        assert_eq!(unsafe { load_rows(&load, &[tags[0] ^ 1]) }, vec![false]);
        assert_eq!(back, vec![0u8; 16]);
        assert_eq!(unsafe { load_rows(&load, &tags) }, vec![true]);
        assert_eq!(back, want);
    }
}
