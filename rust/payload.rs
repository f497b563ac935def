//! XXH3-64 (seed 0) of a store value given as parts: the payload hash of verified reads
//! (`kvstride.stores`). Equal to `xxhash_rust::xxh3::xxh3_64` over the parts' concatenation.
//! The bindings call it with the GIL released and spread a batch of values over rayon's threads;
//! twox-hash chooses its SIMD width (AVX2 where the CPU has it) at run time.

use std::hash::Hasher as _;

use twox_hash::XxHash3_64;

/// XXH3-64 of `parts` concatenated.
pub fn xxh3_64_parts(parts: &[&[u8]]) -> u64 {
    let mut nonempty = parts.iter().filter(|p| !p.is_empty());
    match (nonempty.next(), nonempty.next()) {
        (None, _) => XxHash3_64::oneshot(&[]),
        (Some(one), None) => XxHash3_64::oneshot(one),
        _ => {
            let mut h = XxHash3_64::with_seed(0);
            for p in parts {
                h.write(p);
            }
            h.finish()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::xxh3_64; // an independent implementation of the same digest

    fn data(n: usize) -> Vec<u8> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn one_part_matches_xxhash_rust() {
        let d = data(70_000);
        for n in (0..300).chain([
            1023, 1024, 1025, 1088, 1089, 2047, 2048, 2049, 4096, 16_448, 65_536, 70_000,
        ]) {
            assert_eq!(xxh3_64_parts(&[&d[..n]]), xxh3_64(&d[..n]), "len {n}");
        }
    }

    #[test]
    fn split_parts_match_xxhash_rust() {
        let d = data(9_000);
        for n in [241, 300, 1024, 1025, 1089, 2049, 4097, 9_000] {
            let want = xxh3_64(&d[..n]);
            for cut in [0, 1, 7, 63, 64, 65, 127, 500, 1023, 1024, 1025, 2048, 4096] {
                let cut = cut.min(n);
                for cut2 in [
                    cut,
                    (cut + 1).min(n),
                    (cut + 64).min(n),
                    (cut + 1100).min(n),
                    n,
                ] {
                    let parts = [&d[..cut], &d[cut..cut2], &[][..], &d[cut2..n]];
                    assert_eq!(xxh3_64_parts(&parts), want, "len {n} cuts {cut} {cut2}");
                }
            }
            let bytes: Vec<&[u8]> = d[..n].chunks(1).collect();
            assert_eq!(xxh3_64_parts(&bytes), want, "len {n} in 1-byte parts");
            let odd: Vec<&[u8]> = d[..n].chunks(37).collect();
            assert_eq!(xxh3_64_parts(&odd), want, "len {n} in 37-byte parts");
        }
    }

    #[test]
    fn large_values_in_two_parts() {
        let d = data(1 << 20);
        let (a, b) = d.split_at(1 << 19);
        assert_eq!(xxh3_64_parts(&[a, b]), xxh3_64(&d));
    }
}
