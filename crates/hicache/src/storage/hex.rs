//! Lowercase hex of a [`PageKey`]: how a key appears in file names and Redis keys.

use kv_pool::PageKey;

/// The 64 lowercase hex digits of `key`.
pub(crate) fn key_hex(key: &PageKey) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(64);
    for &b in key {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 0xf) as usize] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::key_hex;

    #[test]
    fn hex_is_lowercase_and_in_byte_order() {
        let mut key = [0u8; 32];
        key[0] = 0xab;
        key[31] = 0x01;
        let h = key_hex(&key);
        assert_eq!(h.len(), 64);
        assert!(h.starts_with("ab00"));
        assert!(h.ends_with("0001"));
    }
}
