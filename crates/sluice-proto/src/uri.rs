//! URI percent-encoding (RFC 3986 §2.1), shared by the CoAP proxy's `Proxy-Uri` and the admin
//! endpoint's query parameters.

/// `%XX` sequences decoded to their bytes, every other byte kept; `None` for a `%` not
/// followed by two hex digits (a sign is not a digit).
pub fn percent_decode(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3)?;
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                // (`from_str_radix` alone would take "%+1" as 1.)
                return None;
            }
            out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_decode_and_bad_ones_are_refused() {
        assert_eq!(
            percent_decode("a%20b%2F%C3%BC").unwrap(),
            "a b/ü".as_bytes()
        );
        assert_eq!(percent_decode("plain+text").unwrap(), b"plain+text");
        for bad in ["%", "%2", "%zz", "a%+1"] {
            assert_eq!(percent_decode(bad), None, "{bad}");
        }
    }
}
