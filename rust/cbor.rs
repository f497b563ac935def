//! The slice of canonical CBOR (RFC 8949 §4.2.1, as Python's `cbor2.dumps(x, canonical=True)`
//! writes it) that a block-hash input can hold.
//!
//! Hand-written rather than taken from a CBOR crate: the hot path appends one token id per
//! call into a reused buffer, and the float rules must match cbor2's byte for byte (shortest
//! of f16/f32/f64 that keeps the value, NaN as `f9 7e00`); serde-based crates cost a multiple
//! of the SHA-256 time on this input and encode NaN differently.

/// A value that may appear in a hash input's extra keys.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    /// Any integer CBOR encodes without a bignum tag: -2^64 ..= 2^64 - 1.
    Int(i128),
    Bytes(Vec<u8>),
    Text(String),
    Float(f64),
    Array(Vec<Value>),
    /// Written with its keys in canonical order (shortest encoding first, then bytewise), as
    /// cbor2's canonical mode does.
    Map(Vec<(Value, Value)>),
}

pub const INT_MIN: i128 = -(1i128 << 64);
pub const INT_MAX: i128 = (1i128 << 64) - 1;

#[inline(always)]
pub fn write_head(buf: &mut Vec<u8>, major: u8, arg: u64) {
    let m = major << 5;
    if arg < 24 {
        buf.push(m | arg as u8);
    } else if arg <= 0xff {
        buf.extend_from_slice(&[m | 24, arg as u8]);
    } else if arg <= 0xffff {
        let b = (arg as u16).to_be_bytes();
        buf.extend_from_slice(&[m | 25, b[0], b[1]]);
    } else if arg <= 0xffff_ffff {
        buf.push(m | 26);
        buf.extend_from_slice(&(arg as u32).to_be_bytes());
    } else {
        buf.push(m | 27);
        buf.extend_from_slice(&arg.to_be_bytes());
    }
}

/// `write_head` into a pre-sized buffer at `pos`, returning the new position. The hot path
/// of block hashing: arguments up to 2^32 - 1 take no data-dependent branch (token ids mix
/// 1-, 3- and 5-byte heads unpredictably). Needs `out.len() >= pos + 9`; it may write zeros
/// past the head, up to `pos + 8`.
#[inline(always)]
pub fn put_head(out: &mut [u8], pos: usize, major: u8, arg: u64) -> usize {
    let m = major << 5;
    if arg > u32::MAX as u64 {
        out[pos] = m | 27;
        out[pos + 1..pos + 9].copy_from_slice(&arg.to_be_bytes());
        return pos + 9;
    }
    let v = arg as u32;
    // size class 0..=3 → 0, 1, 2 or 4 argument bytes after the initial byte
    let class = (v >= 24) as u32 + (v >= 0x100) as u32 + (v >= 0x1_0000) as u32;
    let n = (1u32 << class) >> 1;
    let initial = m as u64
        | if class == 0 {
            v as u64
        } else {
            23 + class as u64
        };
    // The low n bytes of v, big-endian, right after the initial byte.
    let payload = (v.swap_bytes() as u64) >> (32 - 8 * n);
    let word = initial | (payload << 8);
    out[pos..pos + 8].copy_from_slice(&word.to_le_bytes());
    pos + 1 + n as usize
}

/// `put_head` through a raw pointer, for the token loop of block hashing: no bounds check per
/// id (the caller sizes the buffer once per block). Returns the number of head bytes (1, 2,
/// 3, 5 or 9); like `put_head` it may write zeros up to 8 bytes past `dst`.
///
/// # Safety
/// `dst` must be valid for writes of 9 bytes.
#[inline(always)]
pub unsafe fn put_head_unchecked(dst: *mut u8, major: u8, arg: u64) -> usize {
    let m = major << 5;
    if arg > u32::MAX as u64 {
        dst.write(m | 27);
        dst.add(1)
            .cast::<[u8; 8]>()
            .write_unaligned(arg.to_be_bytes());
        return 9;
    }
    // All four candidate encodings, then a select: no variable shift (3 uops each on x86)
    // and no data-dependent branch; this compiles to a handful of cmovs.
    let v = arg as u32;
    let m = m as u64;
    let w1 = m | 24 | (v as u64 & 0xff) << 8;
    let w2 = m | 25 | ((v as u16).swap_bytes() as u64) << 8;
    let w4 = m | 26 | (v.swap_bytes() as u64) << 8;
    let word = if v < 24 {
        m | v as u64
    } else if v < 0x100 {
        w1
    } else if v < 0x1_0000 {
        w2
    } else {
        w4
    };
    dst.cast::<[u8; 8]>().write_unaligned(word.to_le_bytes());
    1 + (v >= 24) as usize + (v >= 0x100) as usize + 2 * (v >= 0x1_0000) as usize
}

/// The length of the head `write_head` writes for `arg`.
#[inline]
pub fn head_len(arg: u64) -> usize {
    match arg {
        0..=23 => 1,
        24..=0xff => 2,
        0x100..=0xffff => 3,
        0x1_0000..=0xffff_ffff => 5,
        _ => 9,
    }
}

/// An integer in -2^64 ..= 2^64 - 1 (callers check the range).
#[inline(always)]
pub fn write_int(buf: &mut Vec<u8>, v: i128) {
    if v >= 0 {
        write_head(buf, 0, v as u64);
    } else {
        write_head(buf, 1, (-1 - v) as u64);
    }
}

pub fn write_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    write_head(buf, 2, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

pub fn write_text(buf: &mut Vec<u8>, text: &str) {
    write_head(buf, 3, text.len() as u64);
    buf.extend_from_slice(text.as_bytes());
}

pub fn write_float(buf: &mut Vec<u8>, v: f64) {
    if v.is_nan() {
        buf.extend_from_slice(&[0xf9, 0x7e, 0x00]);
        return;
    }
    if let Some(half) = f64_to_f16_exact(v) {
        buf.push(0xf9);
        buf.extend_from_slice(&half.to_be_bytes());
    } else if (v as f32) as f64 == v {
        buf.push(0xfa);
        buf.extend_from_slice(&(v as f32).to_be_bytes());
    } else {
        buf.push(0xfb);
        buf.extend_from_slice(&v.to_be_bytes());
    }
}

/// The IEEE half-precision bits of `v` when the conversion is exact, else None.
fn f64_to_f16_exact(v: f64) -> Option<u16> {
    let f = v as f32;
    if f as f64 != v {
        return None;
    }
    let bits = f.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let mant = bits & 0x7f_ffff;
    if exp == 0xff {
        // Infinity (NaN is handled by the caller).
        return Some(sign | 0x7c00);
    }
    if exp == 0 && mant == 0 {
        return Some(sign);
    }
    let e = exp - 127;
    if (-14..=15).contains(&e) {
        // Normal half: 10 mantissa bits must hold all of the f32's.
        if mant & 0x1fff != 0 {
            return None;
        }
        return Some(sign | (((e + 15) as u16) << 10) | (mant >> 13) as u16);
    }
    if (-24..-14).contains(&e) && exp != 0 {
        // Subnormal half: value = m * 2^-24 with m < 1024.
        let full = mant | 0x80_0000; // implicit leading one, value = full * 2^(e-23)
        let shift = (-14 - e) + 13; // bits dropped to reach units of 2^-24
        if full & ((1u32 << shift) - 1) != 0 {
            return None;
        }
        return Some(sign | (full >> shift) as u16);
    }
    None
}

pub fn write_value(buf: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Null => buf.push(0xf6),
        Value::Bool(false) => buf.push(0xf4),
        Value::Bool(true) => buf.push(0xf5),
        Value::Int(v) => write_int(buf, *v),
        Value::Bytes(b) => write_bytes(buf, b),
        Value::Text(t) => write_text(buf, t),
        Value::Float(f) => write_float(buf, *f),
        Value::Array(items) => {
            write_head(buf, 4, items.len() as u64);
            for item in items {
                write_value(buf, item);
            }
        }
        Value::Map(entries) => {
            let mut encoded: Vec<(Vec<u8>, &Value)> =
                entries.iter().map(|(k, v)| (encode(k), v)).collect();
            encoded.sort_by(|a, b| a.0.len().cmp(&b.0.len()).then_with(|| a.0.cmp(&b.0)));
            write_head(buf, 5, encoded.len() as u64);
            for (key, value) in encoded {
                buf.extend_from_slice(&key);
                write_value(buf, value);
            }
        }
    }
}

pub fn encode(value: &Value) -> Vec<u8> {
    let mut buf = Vec::new();
    write_value(&mut buf, value);
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(v: &Value) -> String {
        encode(v).iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn integers_take_the_shortest_head() {
        assert_eq!(hex(&Value::Int(0)), "00");
        assert_eq!(hex(&Value::Int(23)), "17");
        assert_eq!(hex(&Value::Int(24)), "1818");
        assert_eq!(hex(&Value::Int(256)), "190100");
        assert_eq!(hex(&Value::Int(65536)), "1a00010000");
        assert_eq!(hex(&Value::Int(1 << 32)), "1b0000000100000000");
        assert_eq!(hex(&Value::Int(-1)), "20");
        assert_eq!(hex(&Value::Int(-25)), "3818");
        assert_eq!(hex(&Value::Int(INT_MAX)), "1bffffffffffffffff");
        assert_eq!(hex(&Value::Int(INT_MIN)), "3bffffffffffffffff");
    }

    #[test]
    fn put_head_matches_write_head() {
        let mut args: Vec<u64> = vec![0, 1, 23, 24, 255, 256, 65535, 65536, u32::MAX as u64];
        args.extend([u32::MAX as u64 + 1, u64::MAX, 152_063, 1 << 40]);
        args.extend((0..2000u64).map(|i| i * i * 7919));
        for major in [0u8, 1, 4] {
            for &arg in &args {
                let mut expected = Vec::new();
                write_head(&mut expected, major, arg);
                let mut out = [0xaau8; 16];
                let end = put_head(&mut out, 3, major, arg);
                assert_eq!(&out[3..end], &expected[..], "major {major} arg {arg}");
                let mut raw = [0xaau8; 16];
                let n = unsafe { put_head_unchecked(raw.as_mut_ptr().add(3), major, arg) };
                assert_eq!(
                    &raw[3..3 + n],
                    &expected[..],
                    "unchecked: major {major} arg {arg}"
                );
                assert_eq!(head_len(arg), expected.len());
            }
        }
    }

    #[test]
    fn floats_match_cbor2_canonical() {
        assert_eq!(hex(&Value::Float(0.0)), "f90000");
        assert_eq!(hex(&Value::Float(-0.0)), "f98000");
        assert_eq!(hex(&Value::Float(1.5)), "f93e00");
        assert_eq!(hex(&Value::Float(65504.0)), "f97bff");
        assert_eq!(hex(&Value::Float(100000.0)), "fa47c35000");
        assert_eq!(hex(&Value::Float(1.1)), "fb3ff199999999999a");
        assert_eq!(hex(&Value::Float(5.960464477539063e-8)), "f90001");
        assert_eq!(hex(&Value::Float(f64::INFINITY)), "f97c00");
        assert_eq!(hex(&Value::Float(f64::NEG_INFINITY)), "f9fc00");
        assert_eq!(hex(&Value::Float(f64::NAN)), "f97e00");
    }

    #[test]
    fn containers() {
        let v = Value::Array(vec![
            Value::Text("a".into()),
            Value::Bytes(vec![1, 2]),
            Value::Null,
            Value::Bool(true),
            Value::Array(vec![]),
        ]);
        assert_eq!(hex(&v), "856161420102f6f580");
    }
}
