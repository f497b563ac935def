//! A deployment secret (SEMANTICS §3, "Keyed keys"): store keys that cannot be
//! computed without it and value MACs that cannot be forged without it. Three subkeys derived
//! from the secret with BLAKE3's key derivation (the `blake3` crate), one per use:
//!
//! - key names: `hash' = BLAKE3_keyed(k_name, u32_le(|prefix|) ‖ prefix ‖ block_hash)`, as many
//!   bytes as the block hash, where `prefix` is `"{namespace}@group:{g}@"`;
//! - payload tag: `T = u64_le(AEGIS-128X2-MAC(k_payload[..16], payload)[..8])` (RFC 10032's
//!   AEGIS-MAC, zero nonce, 128-bit tag; the `aegis` crate), computed where the XXH3-64 of a
//!   value is computed without a secret (it rides the copies, `regions.rs`). Keyed BLAKE3 ran at
//!   ~3 GB/s a core here, a third of a plain copy; AEGIS-128X2 at ~30 GB/s (BENCHMARKS.md,
//!   Stores / MAC);
//! - header MAC: `BLAKE3_keyed(k_mac, u32_le(|key|) ‖ key ‖ u64_le(len) ‖ u64_le(T))[..16]`, so
//!   the MAC covers key ‖ payload (through T, a MAC of the payload under a key no writer
//!   without the secret has).

use aegis::aegis128x2::Aegis128X2Mac;

/// The state of one value's payload tag: feed the payload's parts in order.
pub type PayloadMac = Aegis128X2Mac<16>;

/// The three subkeys of one secret.
#[derive(Clone)]
pub struct Secret {
    name: [u8; 32],
    payload: [u8; 16],
    mac: [u8; 32],
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)") // never print key material
    }
}

pub const NAME_CONTEXT: &str = "kvstride 2026-12 store key names";
/// A new context for the AEGIS tag (header version 3): no subkey is shared with the BLAKE3 tag of
/// version 2.
pub const PAYLOAD_CONTEXT: &str = "kvstride 2026-12 value payload tag AEGIS-128X2";
pub const MAC_CONTEXT: &str = "kvstride 2026-12 value header mac";
/// At least this much key material (`kvstride.secret.load_secret` enforces it for files).
pub const MIN_SECRET_BYTES: usize = 32;

impl Secret {
    pub fn new(secret: &[u8]) -> crate::Result<Self> {
        if secret.len() < MIN_SECRET_BYTES {
            return Err(crate::Error::new(format!(
                "the secret has {} bytes; it needs at least {MIN_SECRET_BYTES} \
                 (kvstride.secret.generate_secret_file writes one)",
                secret.len()
            )));
        }
        Ok(Secret {
            name: blake3::derive_key(NAME_CONTEXT, secret),
            payload: blake3::derive_key(PAYLOAD_CONTEXT, secret)[..16].try_into().unwrap(),
            mac: blake3::derive_key(MAC_CONTEXT, secret),
        })
    }

    /// The keyed block hash of a key: `len(block_hash)` bytes.
    pub fn name_hash(&self, prefix: &str, block_hash: &[u8], out: &mut [u8]) {
        let mut h = blake3::Hasher::new_keyed(&self.name);
        h.update(&(prefix.len() as u32).to_le_bytes());
        h.update(prefix.as_bytes());
        h.update(block_hash);
        h.finalize_xof().fill(out);
    }

    /// The MAC state for one value's payload tag: feed the payload's parts in order.
    pub fn payload_hasher(&self) -> PayloadMac {
        PayloadMac::new(&self.payload)
    }

    pub fn payload_tag_of(mac: PayloadMac) -> u64 {
        u64::from_le_bytes(mac.finalize()[..8].try_into().unwrap())
    }

    /// The payload tag of `parts` concatenated.
    pub fn payload_tag(&self, parts: &[&[u8]]) -> u64 {
        let mut h = self.payload_hasher();
        for p in parts {
            h.update(p);
        }
        Self::payload_tag_of(h)
    }

    /// The 16-byte MAC a value's header carries.
    pub fn header_mac(&self, key: &[u8], length: u64, tag: u64) -> [u8; 16] {
        let mut h = blake3::Hasher::new_keyed(&self.mac);
        h.update(&(key.len() as u32).to_le_bytes());
        h.update(key);
        h.update(&length.to_le_bytes());
        h.update(&tag.to_le_bytes());
        let mut out = [0u8; 16];
        out.copy_from_slice(&h.finalize().as_bytes()[..16]);
        out
    }

    /// [`header_mac`](Self::header_mac) of each value `(keys[i], lengths[i], tags[i])`.
    pub fn header_macs<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        lengths: &[u64],
        tags: &[u64],
    ) -> crate::Result<Vec<[u8; 16]>> {
        if keys.len() != lengths.len() || keys.len() != tags.len() {
            return Err(crate::Error::new("keys, lengths and tags must have the same length"));
        }
        Ok(keys
            .iter()
            .zip(lengths)
            .zip(tags)
            .map(|((k, &n), &t)| self.header_mac(k.as_ref(), n, t))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_secrets_are_refused() {
        assert!(Secret::new(&[7u8; 31]).is_err());
        assert!(Secret::new(&[7u8; 32]).is_ok());
    }

    #[test]
    fn subkeys_differ_and_depend_on_the_secret() {
        let a = Secret::new(&[1u8; 32]).unwrap();
        let b = Secret::new(&[2u8; 32]).unwrap();
        assert_ne!(a.name[..16], a.payload);
        assert_ne!(a.payload, a.mac[..16]);
        let (mut x, mut y) = ([0u8; 32], [0u8; 32]);
        a.name_hash("m@group:0@", &[9u8; 32], &mut x);
        b.name_hash("m@group:0@", &[9u8; 32], &mut y);
        assert_ne!(x, y);
        b.name_hash("m@group:1@", &[9u8; 32], &mut x);
        assert_ne!(x, y, "the group (prefix) is hashed too");
        assert_ne!(a.payload_tag(&[b"abc"]), b.payload_tag(&[b"abc"]));
        assert_ne!(a.header_mac(b"k", 3, 1), a.header_mac(b"j", 3, 1));
        assert_ne!(a.header_mac(b"k", 3, 1), a.header_mac(b"k", 3, 2));
    }

    #[test]
    fn header_macs_is_header_mac_of_each_value_and_checks_lengths() {
        let s = Secret::new(&[4u8; 32]).unwrap();
        let macs = s.header_macs(&["a", "bc"], &[1, 2], &[7, 8]).unwrap();
        assert_eq!(macs, vec![s.header_mac(b"a", 1, 7), s.header_mac(b"bc", 2, 8)]);
        assert!(s.header_macs::<&str>(&[], &[], &[]).unwrap().is_empty());
        let err = s.header_macs(&["a"], &[1, 2], &[7]).unwrap_err();
        assert_eq!(err.0, "keys, lengths and tags must have the same length");
        assert!(s.header_macs(&["a"], &[1], &[]).is_err());
    }

    #[test]
    fn payload_tag_is_split_invariant() {
        let s = Secret::new(&[5u8; 32]).unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let one = s.payload_tag(&[&data]);
        let (a, b) = data.split_at(1234);
        assert_eq!(s.payload_tag(&[a, b]), one);
        let (c, d) = data.split_at(200_000);
        assert_eq!(s.payload_tag(&[c, &[][..], d]), one);
    }

    #[test]
    fn the_crate_matches_the_aegismac_test_vector() {
        // AEGISMAC-128X2 from the AEGIS RFC's test vectors (also in the crate's test-vectors).
        let hex = |s: &str| (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect::<Vec<u8>>();
        let key: [u8; 16] = hex("10010000000000000000000000000000").try_into().unwrap();
        let nonce: [u8; 16] = hex("10000200000000000000000000000000").try_into().unwrap();
        let data = hex("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122");
        let mut m = PayloadMac::new_with_nonce(&key, &nonce);
        m.update(&data[..5]);
        m.update(&data[5..]);
        assert_eq!(m.finalize().to_vec(), hex("6873ee34e6b5c59143b6d35c5e4f2c6e"));
    }

    #[test]
    fn the_payload_tag_is_aegis128x2_mac_under_the_derived_key() {
        // One independent check of the construction: the crate's one-shot MAC, zero nonce.
        let s = Secret::new(b"0123456789abcdef0123456789abcdef").unwrap();
        let k: [u8; 16] = blake3::derive_key(PAYLOAD_CONTEXT, b"0123456789abcdef0123456789abcdef")[..16].try_into().unwrap();
        let mut m = PayloadMac::new_with_nonce(&k, &[0u8; 16]);
        m.update(b"payload");
        let want = m.finalize();
        assert_eq!(s.payload_tag(&[b"pay", b"load"]), u64::from_le_bytes(want[..8].try_into().unwrap()));
    }
}
