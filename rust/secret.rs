//! A deployment secret (issue 17; SEMANTICS §3, "Keyed keys"): store keys that cannot be
//! computed without it and value MACs that cannot be forged without it. Keyed BLAKE3 (the
//! `blake3` crate), three subkeys derived from the secret, one per use:
//!
//! - key names: `hash' = BLAKE3_keyed(k_name, u32_le(|prefix|) ‖ prefix ‖ block_hash)`, as many
//!   bytes as the block hash, where `prefix` is `"{namespace}@group:{g}@"`;
//! - payload tag: `T = u64_le(BLAKE3_keyed(k_payload, payload)[..8])`, computed where the XXH3-64
//!   of a value is computed without a secret (it rides the copies, `regions.rs`);
//! - header MAC: `BLAKE3_keyed(k_mac, u32_le(|key|) ‖ key ‖ u64_le(len) ‖ u64_le(T))[..16]`, so
//!   the MAC covers key ‖ payload (through T, a PRF of the payload under a key no writer
//!   without the secret has).

/// The three subkeys of one secret.
#[derive(Clone)]
pub struct Secret {
    name: [u8; 32],
    payload: [u8; 32],
    mac: [u8; 32],
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)") // never print key material
    }
}

pub const NAME_CONTEXT: &str = "kvstride 2026-12 store key names";
pub const PAYLOAD_CONTEXT: &str = "kvstride 2026-12 value payload tag";
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
            payload: blake3::derive_key(PAYLOAD_CONTEXT, secret),
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

    /// A hasher for one value's payload tag: feed the payload's parts in order.
    pub fn payload_hasher(&self) -> blake3::Hasher {
        blake3::Hasher::new_keyed(&self.payload)
    }

    pub fn payload_tag_of(hasher: &blake3::Hasher) -> u64 {
        let out = hasher.finalize();
        u64::from_le_bytes(out.as_bytes()[..8].try_into().unwrap())
    }

    /// The payload tag of `parts` concatenated.
    pub fn payload_tag(&self, parts: &[&[u8]]) -> u64 {
        let mut h = self.payload_hasher();
        for p in parts {
            h.update(p);
        }
        Self::payload_tag_of(&h)
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
        assert_ne!(a.name, a.payload);
        assert_ne!(a.payload, a.mac);
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
    fn matches_reference_blake3_keyed() {
        // keyed hash = BLAKE3 in keyed mode with the derived key: one independent check.
        let s = Secret::new(b"0123456789abcdef0123456789abcdef").unwrap();
        let k = blake3::derive_key(PAYLOAD_CONTEXT, b"0123456789abcdef0123456789abcdef");
        let want = blake3::keyed_hash(&k, b"payload");
        assert_eq!(s.payload_tag(&[b"pay", b"load"]), u64::from_le_bytes(want.as_bytes()[..8].try_into().unwrap()));
    }
}
