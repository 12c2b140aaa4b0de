//! The stateless half of the DTLS handshake (RFC 6347 §4.2.1): reading a ClientHello out of
//! a datagram from an address with no session, answering it with a HelloVerifyRequest whose
//! cookie is a MAC of the address, and — once a ClientHello comes back with a valid cookie —
//! the cookie-less ClientHello a fresh OpenSSL session is first shown so that it expects the
//! cookie-bearing one next (OpenSSL's own stateless path, `DTLSv1_listen`, is not in the
//! `openssl` crate; ADR 0006).
//!
//! Owns: the wire format of those records. Does not own: the cookie's MAC (`super::context`)
//! or sessions (`super::session`).
//!
//! Wire format (big endian): a DTLS record is `type(1)=22 version(2)=0xFEFD|0xFEFF epoch(2)=0
//! sequence(6) length(2)` followed by a handshake message `msg_type(1)=1 length(3)
//! message_seq(2) fragment_offset(3)=0 fragment_length(3)=length` whose ClientHello body is
//! `client_version(2) random(32) session_id(1+n) cookie(1+n) …`. Only an unfragmented
//! ClientHello in epoch 0 is accepted (as `DTLSv1_listen` does); anything else from an
//! unknown address is dropped.
//!
//! Invariants: nothing here allocates per address or keeps state; a HelloVerifyRequest is
//! 13 + 12 + 3 + cookie bytes (44 with sluice's 16-byte cookies), smaller than any
//! ClientHello it answers (≥ 67 bytes, `MIN_CLIENT_HELLO`), so it amplifies nothing; no input panics.

/// DTLS record header length.
const RECORD_HEADER: usize = 13;
/// DTLS handshake message header length.
const HANDSHAKE_HEADER: usize = 12;
const CONTENT_HANDSHAKE: u8 = 22;
const CLIENT_HELLO: u8 = 1;
const HELLO_VERIFY_REQUEST: u8 = 3;
/// Smallest ClientHello datagram: the headers, version, random, two empty length bytes, and
/// at least one cipher suite and compression method (2 + 2 + 1 + 1).
pub const MIN_CLIENT_HELLO: usize = RECORD_HEADER + HANDSHAKE_HEADER + 2 + 32 + 1 + 1 + 6;

/// A ClientHello read out of a datagram: offsets into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientHello {
    /// The record's 48-bit sequence number.
    pub record_seq: u64,
    /// Where the cookie length byte is (the cookie follows).
    cookie_at: usize,
    cookie_len: usize,
    /// End of the first record (start of whatever follows it in the datagram).
    record_end: usize,
}

impl ClientHello {
    /// The first record of `d`, if it is an unfragmented epoch-0 ClientHello.
    pub fn parse(d: &[u8]) -> Option<ClientHello> {
        if d.len() < MIN_CLIENT_HELLO || d[0] != CONTENT_HANDSHAKE || d[1] != 0xFE {
            return None;
        }
        if d[3..5] != [0, 0] {
            return None;
        }
        let record_seq = d[5..11].iter().fold(0u64, |a, b| a << 8 | *b as u64);
        let len = u16::from_be_bytes([d[11], d[12]]) as usize;
        let record_end = RECORD_HEADER.checked_add(len)?;
        let r = d.get(RECORD_HEADER..record_end)?;
        if r.len() < HANDSHAKE_HEADER || r[0] != CLIENT_HELLO {
            return None;
        }
        let u24 = |b: &[u8]| (b[0] as usize) << 16 | (b[1] as usize) << 8 | b[2] as usize;
        let body_len = u24(&r[1..4]);
        if u24(&r[6..9]) != 0 || u24(&r[9..12]) != body_len {
            return None;
        }
        let body = r.get(HANDSHAKE_HEADER..HANDSHAKE_HEADER + body_len)?;
        // version(2) random(32) session_id(1+n)
        let sid_len = *body.get(34)? as usize;
        if sid_len > 32 {
            return None;
        }
        let cookie_in_body = 35 + sid_len;
        let cookie_len = *body.get(cookie_in_body)? as usize;
        body.get(cookie_in_body + 1..cookie_in_body + 1 + cookie_len)?;
        Some(ClientHello {
            record_seq,
            cookie_at: RECORD_HEADER + HANDSHAKE_HEADER + cookie_in_body,
            cookie_len,
            record_end,
        })
    }

    /// The client's random (the same in both ClientHellos of one handshake, RFC 6347
    /// §4.2.1; a new one means a new handshake).
    pub fn random<'a>(&self, d: &'a [u8]) -> &'a [u8] {
        let at = RECORD_HEADER + HANDSHAKE_HEADER + 2;
        &d[at..at + 32]
    }

    /// The cookie it carries (empty on a first ClientHello).
    pub fn cookie<'a>(&self, d: &'a [u8]) -> &'a [u8] {
        &d[self.cookie_at + 1..self.cookie_at + 1 + self.cookie_len]
    }

    /// The HelloVerifyRequest answering it with `cookie` (RFC 6347 §4.2.1: version DTLS 1.0,
    /// the ClientHello's record sequence number, message_seq 0).
    pub fn verify_request(&self, cookie: &[u8]) -> Vec<u8> {
        let cookie = &cookie[..cookie.len().min(255)];
        let body_len = 3 + cookie.len();
        let mut out = Vec::with_capacity(RECORD_HEADER + HANDSHAKE_HEADER + body_len);
        out.extend_from_slice(&[CONTENT_HANDSHAKE, 0xFE, 0xFF, 0, 0]);
        out.extend_from_slice(&self.record_seq.to_be_bytes()[2..]);
        out.extend_from_slice(&((HANDSHAKE_HEADER + body_len) as u16).to_be_bytes());
        out.push(HELLO_VERIFY_REQUEST);
        out.extend_from_slice(&(body_len as u32).to_be_bytes()[1..]);
        out.extend_from_slice(&[0, 0, 0, 0, 0]);
        out.extend_from_slice(&(body_len as u32).to_be_bytes()[1..]);
        out.extend_from_slice(&[0xFE, 0xFF, cookie.len() as u8]);
        out.extend_from_slice(cookie);
        out
    }

    /// The first record of `d` as the ClientHello that preceded it: no cookie, message_seq
    /// 0, and a record sequence number other than its own (so OpenSSL's replay window takes
    /// both). Shown to a fresh session so that it answers (a HelloVerifyRequest, discarded)
    /// and then expects `d` itself, as after `DTLSv1_listen`.
    pub fn without_cookie(&self, d: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.record_end - self.cookie_len);
        out.extend_from_slice(&d[..self.cookie_at]);
        out.push(0);
        out.extend_from_slice(&d[self.cookie_at + 1 + self.cookie_len..self.record_end]);
        let seq = if self.record_seq == 0 {
            1
        } else {
            self.record_seq - 1
        };
        out[5..11].copy_from_slice(&seq.to_be_bytes()[2..]);
        let shrink = |b: &mut [u8], by: usize, width: usize| {
            let v = b[..width].iter().fold(0usize, |a, x| a << 8 | *x as usize) - by;
            for (i, x) in b[..width].iter_mut().enumerate() {
                *x = (v >> (8 * (width - 1 - i))) as u8;
            }
        };
        let by = self.cookie_len;
        shrink(&mut out[11..13], by, 2);
        shrink(&mut out[RECORD_HEADER + 1..RECORD_HEADER + 4], by, 3);
        out[RECORD_HEADER + 4..RECORD_HEADER + 6].copy_from_slice(&[0, 0]);
        shrink(&mut out[RECORD_HEADER + 9..RECORD_HEADER + 12], by, 3);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ClientHello datagram: record seq `seq`, message_seq `mseq`, `cookie`.
    pub(crate) fn client_hello(seq: u8, mseq: u8, cookie: &[u8]) -> Vec<u8> {
        let mut body = vec![0xFE, 0xFD];
        body.extend_from_slice(&[7u8; 32]);
        body.push(0); // session id
        body.push(cookie.len() as u8);
        body.extend_from_slice(cookie);
        body.extend_from_slice(&[0, 2, 0x00, 0xA8, 1, 0]); // one suite, null compression
        let mut hs = vec![CLIENT_HELLO, 0, 0, body.len() as u8, 0, mseq, 0, 0, 0, 0, 0];
        hs.push(body.len() as u8);
        hs.extend_from_slice(&body);
        let mut d = vec![22, 0xFE, 0xFD, 0, 0, 0, 0, 0, 0, 0, seq, 0, hs.len() as u8];
        d.extend_from_slice(&hs);
        d
    }

    #[test]
    fn a_first_client_hello_is_answered_with_a_small_verify_request_echoing_its_sequence() {
        let d = client_hello(5, 0, &[]);
        let ch = ClientHello::parse(&d).expect("a ClientHello");
        assert_eq!(ch.cookie(&d), b"");
        let hvr = ch.verify_request(&[9u8; 16]);
        assert_eq!(hvr.len(), 44);
        assert!(hvr.len() <= d.len(), "{} > {}", hvr.len(), d.len());
        assert_eq!(&hvr[..3], &[22, 0xFE, 0xFF]);
        assert_eq!(hvr[10], 5, "record sequence echoed");
        assert_eq!(hvr[13], HELLO_VERIFY_REQUEST);
        assert_eq!(&hvr[hvr.len() - 16..], &[9u8; 16]);
    }

    #[test]
    fn without_cookie_gives_the_first_hello_back() {
        let first = client_hello(0, 0, &[]);
        let second = client_hello(1, 1, &[3u8; 16]);
        let ch = ClientHello::parse(&second).expect("parse");
        assert_eq!(ch.cookie(&second), &[3u8; 16]);
        let mut rebuilt = ch.without_cookie(&second);
        // The real first one but for the record sequence (second's minus one).
        assert_eq!(rebuilt[10], 0);
        rebuilt[10] = first[10];
        assert_eq!(rebuilt, first);
        let ch0 = ClientHello::parse(&first).expect("parse first");
        assert_eq!(ch0.without_cookie(&first)[10], 1, "seq 0 becomes 1");
    }

    #[test]
    fn anything_but_an_unfragmented_epoch_0_client_hello_is_refused_and_no_input_panics() {
        let good = client_hello(1, 1, &[1, 2, 3]);
        assert!(ClientHello::parse(&good).is_some());
        for cut in 0..good.len() {
            let _ = ClientHello::parse(&good[..cut]);
        }
        let mut epoch1 = good.clone();
        epoch1[4] = 1;
        assert!(ClientHello::parse(&epoch1).is_none());
        let mut fragmented = good.clone();
        fragmented[RECORD_HEADER + 11] -= 1;
        assert!(ClientHello::parse(&fragmented).is_none());
        let mut app = good.clone();
        app[0] = 23;
        assert!(ClientHello::parse(&app).is_none());
        for i in 0..good.len() {
            for v in [0u8, 0x7F, 0xFF] {
                let mut d = good.clone();
                d[i] = v;
                if let Some(ch) = ClientHello::parse(&d) {
                    let _ = ch.without_cookie(&d);
                    let _ = ch.verify_request(ch.cookie(&d));
                }
            }
        }
    }
}
