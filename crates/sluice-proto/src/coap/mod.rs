//! CoAP (RFC 7252) and CoAP over TCP (RFC 8323), sans-IO: messages, options, codes, tokens,
//! block-wise values (RFC 7959). Bytes in, messages out; no sockets, no clocks.
//!
//! Modules: [`message`] (the message and its UDP encoding; the option/payload encoding
//! shared with TCP), [`tcp`] (RFC 8323 framing and signalling messages), [`dedup`]
//! (message-id de-duplication), [`reliability`] (CON retransmission schedule), [`block`]
//! (Block1 reassembly, Block2 slices), [`link`] (RFC 6690 link-format writer).

pub mod block;
pub mod dedup;
pub mod link;
pub mod message;
pub mod reliability;
pub mod tcp;

use std::fmt;

pub use message::{CoapOption, DecodeError, DecodeErrorKind, Header, Message, MsgType};
pub use tcp::{decode_tcp, encode_tcp};

/// Option numbers (RFC 7252 §5.10, RFC 7641, RFC 7959, RFC 7967).
pub mod opt {
    pub const IF_MATCH: u16 = 1;
    pub const URI_HOST: u16 = 3;
    pub const ETAG: u16 = 4;
    pub const IF_NONE_MATCH: u16 = 5;
    pub const OBSERVE: u16 = 6;
    pub const URI_PORT: u16 = 7;
    pub const LOCATION_PATH: u16 = 8;
    pub const URI_PATH: u16 = 11;
    pub const CONTENT_FORMAT: u16 = 12;
    pub const MAX_AGE: u16 = 14;
    pub const URI_QUERY: u16 = 15;
    pub const ACCEPT: u16 = 17;
    pub const LOCATION_QUERY: u16 = 20;
    pub const BLOCK2: u16 = 23;
    pub const BLOCK1: u16 = 27;
    pub const SIZE2: u16 = 28;
    pub const PROXY_URI: u16 = 35;
    pub const PROXY_SCHEME: u16 = 39;
    pub const SIZE1: u16 = 60;
    /// RFC 9175 §2: a server's freshness/reachability challenge the client echoes back.
    pub const ECHO: u16 = 252;
    pub const NO_RESPONSE: u16 = 258;

    /// Odd option numbers are critical: a request carrying one the receiver does not know
    /// must be refused (4.02 Bad Option).
    pub fn is_critical(number: u16) -> bool {
        number & 1 == 1
    }
    /// Unsafe to forward: a proxy that does not know it must not forward the request.
    pub fn is_unsafe(number: u16) -> bool {
        number & 2 == 2
    }
}

/// Content-Format numbers sluice knows by name.
pub mod format {
    pub const TEXT_PLAIN: u16 = 0;
    pub const LINK_FORMAT: u16 = 40;
    pub const OCTET_STREAM: u16 = 42;
    pub const JSON: u16 = 50;
    pub const CBOR: u16 = 60;
    pub const SENML_JSON: u16 = 110;
    pub const SENML_CBOR: u16 = 112;
}

/// A message code: `class.detail` in one byte (`class << 5 | detail`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Code(pub u8);

impl Code {
    pub const fn new(class: u8, detail: u8) -> Code {
        Code((class & 7) << 5 | (detail & 0x1F))
    }
    pub const EMPTY: Code = Code::new(0, 0);
    pub const GET: Code = Code::new(0, 1);
    pub const POST: Code = Code::new(0, 2);
    pub const PUT: Code = Code::new(0, 3);
    pub const DELETE: Code = Code::new(0, 4);
    pub const FETCH: Code = Code::new(0, 5);
    pub const PATCH: Code = Code::new(0, 6);
    pub const IPATCH: Code = Code::new(0, 7);
    pub const CREATED: Code = Code::new(2, 1);
    pub const DELETED: Code = Code::new(2, 2);
    pub const VALID: Code = Code::new(2, 3);
    pub const CHANGED: Code = Code::new(2, 4);
    pub const CONTENT: Code = Code::new(2, 5);
    pub const CONTINUE: Code = Code::new(2, 31);
    pub const BAD_REQUEST: Code = Code::new(4, 0);
    pub const UNAUTHORIZED: Code = Code::new(4, 1);
    pub const BAD_OPTION: Code = Code::new(4, 2);
    pub const FORBIDDEN: Code = Code::new(4, 3);
    pub const NOT_FOUND: Code = Code::new(4, 4);
    pub const METHOD_NOT_ALLOWED: Code = Code::new(4, 5);
    pub const NOT_ACCEPTABLE: Code = Code::new(4, 6);
    pub const REQUEST_ENTITY_INCOMPLETE: Code = Code::new(4, 8);
    pub const PRECONDITION_FAILED: Code = Code::new(4, 12);
    pub const REQUEST_ENTITY_TOO_LARGE: Code = Code::new(4, 13);
    pub const UNSUPPORTED_CONTENT_FORMAT: Code = Code::new(4, 15);
    pub const INTERNAL_SERVER_ERROR: Code = Code::new(5, 0);
    pub const NOT_IMPLEMENTED: Code = Code::new(5, 1);
    pub const BAD_GATEWAY: Code = Code::new(5, 2);
    pub const SERVICE_UNAVAILABLE: Code = Code::new(5, 3);
    pub const GATEWAY_TIMEOUT: Code = Code::new(5, 4);
    pub const PROXYING_NOT_SUPPORTED: Code = Code::new(5, 5);
    /// RFC 8323 signalling codes (7.xx), TCP only.
    pub const CSM: Code = Code::new(7, 1);
    pub const PING: Code = Code::new(7, 2);
    pub const PONG: Code = Code::new(7, 3);
    pub const RELEASE: Code = Code::new(7, 4);
    pub const ABORT: Code = Code::new(7, 5);

    pub const fn class(self) -> u8 {
        self.0 >> 5
    }
    pub const fn detail(self) -> u8 {
        self.0 & 0x1F
    }
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// 0.01–0.31.
    pub const fn is_request(self) -> bool {
        self.class() == 0 && self.detail() != 0
    }
    /// 2.xx–5.xx.
    pub const fn is_response(self) -> bool {
        self.class() >= 2 && self.class() <= 5
    }
    pub const fn is_success(self) -> bool {
        self.class() == 2
    }
    /// 7.xx (RFC 8323).
    pub const fn is_signal(self) -> bool {
        self.class() == 7
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:02}", self.class(), self.detail())
    }
}

impl fmt::Debug for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Code({self})")
    }
}

/// A token: 0 to 8 bytes, inline (cheap to copy and to use as a map key).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Token {
    len: u8,
    bytes: [u8; 8],
}

impl Token {
    pub const EMPTY: Token = Token {
        len: 0,
        bytes: [0; 8],
    };
    /// `None` when longer than 8 bytes.
    pub fn from_slice(s: &[u8]) -> Option<Token> {
        if s.len() > 8 {
            return None;
        }
        let mut bytes = [0; 8];
        bytes[..s.len()].copy_from_slice(s);
        Some(Token {
            len: s.len() as u8,
            bytes,
        })
    }
    /// A token of the 8 bytes of `v` (for tokens a sender makes up).
    pub fn from_u64(v: u64) -> Token {
        Token {
            len: 8,
            bytes: v.to_be_bytes(),
        }
    }
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
    pub fn len(&self) -> usize {
        self.len as usize
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(")?;
        for b in self.as_slice() {
            write!(f, "{b:02x}")?;
        }
        f.write_str(")")
    }
}

/// A Block1/Block2 option value (RFC 7959 §2.2): block number, more flag, size exponent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub num: u32,
    pub more: bool,
    /// Size exponent: the block holds `2^(szx + 4)` bytes; 0..=6 (7 is BERT, TCP only).
    pub szx: u8,
}

impl Block {
    /// Decode a uint option value; `None` when over 3 bytes.
    pub fn from_uint(v: u32) -> Option<Block> {
        if v > 0x00FF_FFFF {
            return None;
        }
        Some(Block {
            num: v >> 4,
            more: v & 0x8 != 0,
            szx: (v & 0x7) as u8,
        })
    }
    pub fn to_uint(self) -> u32 {
        self.num << 4 | (self.more as u32) << 3 | (self.szx as u32 & 7)
    }
    /// Bytes per block (1024 for BERT's SZX 7, which means "multiples of 1024").
    pub fn size(self) -> usize {
        1 << (self.szx.min(6) as usize + 4)
    }
    /// Offset of this block's first byte.
    pub fn offset(self) -> usize {
        self.num as usize * self.size()
    }
    /// The largest SZX whose block size is at most `bytes` (at least 0: 16 bytes).
    pub fn szx_for(bytes: usize) -> u8 {
        let mut szx = 6u8;
        while szx > 0 && (1usize << (szx + 4)) > bytes {
            szx -= 1;
        }
        szx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_print_as_class_dot_detail() {
        assert_eq!(Code::CHANGED.to_string(), "2.04");
        assert_eq!(Code::SERVICE_UNAVAILABLE.0, 0xA3);
        assert_eq!(Code::CONTINUE.0, 0x5F);
        assert!(Code::GET.is_request() && !Code::EMPTY.is_request());
        assert!(Code::PONG.is_signal());
    }

    #[test]
    fn block_values_round_trip() {
        let b = Block::from_uint(0x12).unwrap(); // NUM=1 M=0 SZX=2
        assert_eq!(
            b,
            Block {
                num: 1,
                more: false,
                szx: 2
            }
        );
        assert_eq!(b.size(), 64);
        assert_eq!(b.offset(), 64);
        assert_eq!(b.to_uint(), 0x12);
        assert_eq!(Block::szx_for(1024), 6);
        assert_eq!(Block::szx_for(1000), 5);
        assert_eq!(Block::szx_for(3), 0);
        assert!(Block::from_uint(0x0100_0000).is_none());
    }

    #[test]
    fn tokens_hold_at_most_eight_bytes() {
        assert!(Token::from_slice(&[0; 9]).is_none());
        let t = Token::from_slice(&[1, 2]).unwrap();
        assert_eq!(t.as_slice(), &[1, 2]);
        assert_eq!(format!("{t:?}"), "Token(0102)");
    }
}
