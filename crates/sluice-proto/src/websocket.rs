//! WebSocket framing (RFC 6455 §5), server side, sans-IO: client frames in, the payload bytes
//! of binary messages out as one byte stream; server frames' headers written.
//!
//! Owns: the frame header, unmasking, message fragmentation, control frames (ping, pong,
//! close) and their limits. Does not own: the HTTP upgrade (the gateway's
//! `edge/mqtt/stream/ws.rs`), what the bytes mean (MQTT: a packet may span frames and a frame
//! may carry several packets, so the payload is a plain byte stream to the MQTT decoder) or
//! any socket.
//!
//! Wire format (client to server): `FIN RSV1-3 opcode(4) | MASK len(7) [len 16 | len 64]
//! mask-key(4) payload`. Rules enforced, each a [`FrameError`] carrying the close code the
//! server answers with: every client frame is masked (1002); no RSV bit is set (no extension
//! is negotiated, 1002); opcodes are continuation, binary, close, ping, pong (text: 1003,
//! others: 1002); a continuation only inside a fragmented message and a new data frame only
//! outside one (1002); control frames are unfragmented with at most 125 bytes of payload
//! (1002); a close payload is empty or a 2-byte code plus UTF-8 reason (1002); a data frame's
//! payload is at most the decoder's `max_frame` (1009).
//!
//! Invariants: data payload is streamed — unmasked from the input straight into the output
//! as it arrives, so a frame of any allowed size costs no buffer of its own here, and the
//! decoder's state is a few integers; a control frame is consumed only once it is complete
//! (at most 2 + 4 + 125 bytes wait in the caller's input). No input panics.

use bytes::{Buf, BufMut, BytesMut};

/// Opcodes (RFC 6455 §5.2).
const OP_CONTINUATION: u8 = 0x0;
const OP_TEXT: u8 = 0x1;
const OP_BINARY: u8 = 0x2;
const OP_CLOSE: u8 = 0x8;
const OP_PING: u8 = 0x9;
const OP_PONG: u8 = 0xA;

/// Close codes (RFC 6455 §7.4.1).
pub const CLOSE_NORMAL: u16 = 1000;
pub const CLOSE_PROTOCOL_ERROR: u16 = 1002;
pub const CLOSE_UNSUPPORTED_DATA: u16 = 1003;
pub const CLOSE_TOO_BIG: u16 = 1009;

/// Largest control-frame payload.
const MAX_CONTROL_PAYLOAD: usize = 125;

/// Why a client's frames cannot be read; the connection is closed with [`FrameError::close_code`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("client frame not masked")]
    Unmasked,
    #[error("reserved bit set without a negotiated extension")]
    ReservedBits,
    #[error("text frame (MQTT over WebSocket is binary)")]
    Text,
    #[error("unknown opcode {0:#x}")]
    UnknownOpcode(u8),
    #[error("continuation frame outside a fragmented message")]
    StrayContinuation,
    #[error("new data frame inside a fragmented message")]
    InterleavedMessage,
    #[error("control frame fragmented or longer than 125 bytes")]
    BadControlFrame,
    #[error("close frame with a 1-byte payload")]
    BadClosePayload,
    #[error("frame of {len} bytes is larger than the limit of {max}")]
    TooBig { len: u64, max: u64 },
}

impl FrameError {
    /// The close code the server sends before closing.
    pub fn close_code(self) -> u16 {
        match self {
            FrameError::Text => CLOSE_UNSUPPORTED_DATA,
            FrameError::TooBig { .. } => CLOSE_TOO_BIG,
            _ => CLOSE_PROTOCOL_ERROR,
        }
    }
}

/// A control frame the caller must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Answer with a pong carrying this payload ([`encode_pong`]).
    Ping(BytesMut),
    /// The client closes (code, if it sent one): answer with a close and stop reading.
    Close(Option<u16>),
}

/// Decodes client frames. Feed it with [`FrameDecoder::decode`].
#[derive(Debug, Clone)]
pub struct FrameDecoder {
    max_frame: u64,
    /// Payload bytes of the current data frame not yet seen.
    remaining: u64,
    mask: [u8; 4],
    /// Offset into `mask` of the next payload byte.
    mask_at: u8,
    /// A fragmented message is open (its last frame had FIN clear).
    in_message: bool,
}

impl FrameDecoder {
    /// A decoder refusing data frames longer than `max_frame` bytes.
    pub fn new(max_frame: u64) -> FrameDecoder {
        FrameDecoder {
            max_frame,
            remaining: 0,
            mask: [0; 4],
            mask_at: 0,
            in_message: false,
        }
    }

    /// Whether the decoder is in the middle of nothing: no frame open. (A fragmented message
    /// may still be open: its next frame is a new frame.)
    pub fn at_frame_boundary(&self) -> bool {
        self.remaining == 0
    }

    /// Consume from `input` every complete header and all available payload, appending the
    /// unmasked payload of binary messages to `out`. Stops at the first complete control
    /// frame (returned) or when `input` holds no more progress (`Ok(None)`: bytes of an
    /// incomplete header or control frame stay in `input`).
    pub fn decode(
        &mut self,
        input: &mut BytesMut,
        out: &mut BytesMut,
    ) -> Result<Option<Control>, FrameError> {
        loop {
            if self.remaining > 0 {
                if input.is_empty() {
                    return Ok(None);
                }
                let n = (self.remaining.min(input.len() as u64)) as usize;
                out.reserve(n);
                for &b in &input[..n] {
                    out.put_u8(b ^ self.mask[self.mask_at as usize]);
                    self.mask_at = (self.mask_at + 1) & 3;
                }
                input.advance(n);
                self.remaining -= n as u64;
                continue;
            }
            let Some(header) = parse_header(input)? else {
                return Ok(None);
            };
            match header.opcode {
                OP_BINARY | OP_CONTINUATION | OP_TEXT => {
                    match header.opcode {
                        OP_TEXT => return Err(FrameError::Text),
                        OP_CONTINUATION if !self.in_message => {
                            return Err(FrameError::StrayContinuation)
                        }
                        OP_BINARY if self.in_message => return Err(FrameError::InterleavedMessage),
                        _ => {}
                    }
                    if header.len > self.max_frame {
                        return Err(FrameError::TooBig {
                            len: header.len,
                            max: self.max_frame,
                        });
                    }
                    input.advance(header.header_len);
                    self.in_message = !header.fin;
                    self.remaining = header.len;
                    self.mask = header.mask;
                    self.mask_at = 0;
                }
                OP_CLOSE | OP_PING | OP_PONG => {
                    if !header.fin || header.len > MAX_CONTROL_PAYLOAD as u64 {
                        return Err(FrameError::BadControlFrame);
                    }
                    let total = header.header_len + header.len as usize;
                    if input.len() < total {
                        return Ok(None);
                    }
                    input.advance(header.header_len);
                    let mut payload = input.split_to(header.len as usize);
                    for (i, b) in payload.iter_mut().enumerate() {
                        *b ^= header.mask[i & 3];
                    }
                    match header.opcode {
                        OP_PING => return Ok(Some(Control::Ping(payload))),
                        OP_PONG => continue,
                        _ => {
                            return match payload.len() {
                                0 => Ok(Some(Control::Close(None))),
                                1 => Err(FrameError::BadClosePayload),
                                _ => Ok(Some(Control::Close(Some(u16::from_be_bytes([
                                    payload[0], payload[1],
                                ]))))),
                            }
                        }
                    }
                }
                other => return Err(FrameError::UnknownOpcode(other)),
            }
        }
    }
}

struct Header {
    fin: bool,
    opcode: u8,
    len: u64,
    mask: [u8; 4],
    header_len: usize,
}

/// The frame header at the start of `input`, if complete; nothing is consumed.
fn parse_header(input: &[u8]) -> Result<Option<Header>, FrameError> {
    if input.len() < 2 {
        return Ok(None);
    }
    let (b0, b1) = (input[0], input[1]);
    if b0 & 0x70 != 0 {
        return Err(FrameError::ReservedBits);
    }
    if b1 & 0x80 == 0 {
        return Err(FrameError::Unmasked);
    }
    let (len, at) = match b1 & 0x7F {
        126 => {
            if input.len() < 4 {
                return Ok(None);
            }
            (u16::from_be_bytes([input[2], input[3]]) as u64, 4)
        }
        127 => {
            if input.len() < 10 {
                return Ok(None);
            }
            let mut b = [0u8; 8];
            b.copy_from_slice(&input[2..10]);
            // The most significant bit must be 0 (§5.2); such a length is too big anyway.
            (u64::from_be_bytes(b), 10)
        }
        n => (n as u64, 2),
    };
    if input.len() < at + 4 {
        return Ok(None);
    }
    let mut mask = [0u8; 4];
    mask.copy_from_slice(&input[at..at + 4]);
    Ok(Some(Header {
        fin: b0 & 0x80 != 0,
        opcode: b0 & 0x0F,
        len,
        mask,
        header_len: at + 4,
    }))
}

/// Append the header of one unmasked server binary frame (FIN set) of `len` payload bytes.
pub fn encode_binary_header(len: usize, out: &mut BytesMut) {
    encode_header(OP_BINARY, len, out);
}

/// Append a pong answering a ping with `payload` (at most 125 bytes, as the ping's).
pub fn encode_pong(payload: &[u8], out: &mut BytesMut) {
    let payload = &payload[..payload.len().min(MAX_CONTROL_PAYLOAD)];
    encode_header(OP_PONG, payload.len(), out);
    out.put_slice(payload);
}

/// Append a close frame with `code`.
pub fn encode_close(code: u16, out: &mut BytesMut) {
    encode_header(OP_CLOSE, 2, out);
    out.put_u16(code);
}

fn encode_header(opcode: u8, len: usize, out: &mut BytesMut) {
    out.put_u8(0x80 | opcode);
    if len < 126 {
        out.put_u8(len as u8);
    } else if len <= u16::MAX as usize {
        out.put_u8(126);
        out.put_u16(len as u16);
    } else {
        out.put_u8(127);
        out.put_u64(len as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A client frame: masked with `mask`.
    fn client_frame(fin: bool, opcode: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
        let mut out = BytesMut::new();
        encode_header(opcode, payload.len(), &mut out);
        if !fin {
            out[0] &= 0x7F;
        }
        out[1] |= 0x80;
        out.put_slice(&mask);
        for (i, b) in payload.iter().enumerate() {
            out.put_u8(b ^ mask[i & 3]);
        }
        out.to_vec()
    }

    fn decode_all(d: &mut FrameDecoder, bytes: &[u8]) -> (Vec<u8>, Vec<Control>) {
        let mut input = BytesMut::from(bytes);
        let mut out = BytesMut::new();
        let mut controls = Vec::new();
        while let Some(c) = d.decode(&mut input, &mut out).expect("valid frames") {
            controls.push(c);
        }
        (out.to_vec(), controls)
    }

    #[test]
    fn rfc6455_masked_example_is_unmasked() {
        // RFC 6455 §5.7 "A single-frame masked text message" with the opcode made binary.
        let frame = [
            0x82, 0x85, 0x37, 0xfa, 0x21, 0x3d, 0x7f, 0x9f, 0x4d, 0x51, 0x58,
        ];
        let (data, controls) = decode_all(&mut FrameDecoder::new(1024), &frame);
        assert_eq!(data, b"Hello");
        assert!(controls.is_empty());
    }

    #[test]
    fn fragments_and_pings_between_them_make_one_stream() {
        let mask = [1, 2, 3, 4];
        let mut bytes = client_frame(false, OP_BINARY, b"\x10\x0c\x00", mask);
        bytes.extend(client_frame(true, OP_PING, b"hi", mask));
        bytes.extend(client_frame(true, OP_CONTINUATION, b"\x04MQTT", mask));
        let mut d = FrameDecoder::new(1024);
        let (data, controls) = decode_all(&mut d, &bytes);
        assert_eq!(data, b"\x10\x0c\x00\x04MQTT");
        assert_eq!(controls, vec![Control::Ping(BytesMut::from(&b"hi"[..]))]);
    }

    #[test]
    fn close_frame_gives_its_code() {
        let bytes = client_frame(true, OP_CLOSE, &1001u16.to_be_bytes(), [9, 9, 9, 9]);
        let (_, controls) = decode_all(&mut FrameDecoder::new(1024), &bytes);
        assert_eq!(controls, vec![Control::Close(Some(1001))]);
    }

    #[test]
    fn bad_frames_are_refused_with_their_close_code() {
        let mask = [0; 4];
        let cases: Vec<(Vec<u8>, u16)> = vec![
            (vec![0x82, 0x01, b'x'], CLOSE_PROTOCOL_ERROR), // unmasked
            (
                client_frame(true, OP_TEXT, b"x", mask),
                CLOSE_UNSUPPORTED_DATA,
            ),
            (
                client_frame(true, OP_CONTINUATION, b"x", mask),
                CLOSE_PROTOCOL_ERROR,
            ),
            (client_frame(true, 0x3, b"x", mask), CLOSE_PROTOCOL_ERROR),
            (
                client_frame(false, OP_PING, b"x", mask),
                CLOSE_PROTOCOL_ERROR,
            ),
            (
                client_frame(true, OP_PING, &[0; 126], mask),
                CLOSE_PROTOCOL_ERROR,
            ),
            (
                client_frame(true, OP_CLOSE, b"x", mask),
                CLOSE_PROTOCOL_ERROR,
            ),
            (client_frame(true, OP_BINARY, &[0; 65], mask), CLOSE_TOO_BIG),
        ];
        for (bytes, code) in cases {
            let mut input = BytesMut::from(&bytes[..]);
            let err = FrameDecoder::new(64)
                .decode(&mut input, &mut BytesMut::new())
                .expect_err("refused");
            assert_eq!(err.close_code(), code, "{err}");
        }
        let mut with_rsv = client_frame(true, OP_BINARY, b"x", mask);
        with_rsv[0] |= 0x40;
        assert_eq!(
            FrameDecoder::new(64).decode(&mut BytesMut::from(&with_rsv[..]), &mut BytesMut::new()),
            Err(FrameError::ReservedBits)
        );
    }

    #[test]
    fn a_huge_64_bit_length_is_refused_from_the_header_alone() {
        let mut input = BytesMut::from(&[0x82u8, 0xFF, 0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4][..]);
        let err = FrameDecoder::new(1 << 20)
            .decode(&mut input, &mut BytesMut::new())
            .expect_err("too big");
        assert_eq!(err.close_code(), CLOSE_TOO_BIG);
    }

    #[test]
    fn server_headers_use_the_shortest_length_form() {
        for (len, head) in [(5usize, 2usize), (126, 4), (65_535, 4), (65_536, 10)] {
            let mut out = BytesMut::new();
            encode_binary_header(len, &mut out);
            assert_eq!(out.len(), head, "len {len}");
            assert_eq!(out[0], 0x82);
        }
    }

    proptest! {
        /// Split at every offset: the same stream and the same controls come out.
        #[test]
        fn split_anywhere_decodes_the_same(
            parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..5),
            mask in any::<[u8; 4]>(),
            split in any::<prop::sample::Index>(),
        ) {
            let mut bytes = Vec::new();
            let mut want = Vec::new();
            for (i, p) in parts.iter().enumerate() {
                let last = i + 1 == parts.len();
                let op = if i == 0 { OP_BINARY } else { OP_CONTINUATION };
                bytes.extend(client_frame(last, op, p, mask));
                bytes.extend(client_frame(true, OP_PONG, b"", mask));
                want.extend_from_slice(p);
            }
            let at = split.index(bytes.len() + 1);
            let mut d = FrameDecoder::new(1024);
            let mut input = BytesMut::from(&bytes[..at]);
            let mut out = BytesMut::new();
            prop_assert_eq!(d.decode(&mut input, &mut out), Ok(None));
            input.extend_from_slice(&bytes[at..]);
            prop_assert_eq!(d.decode(&mut input, &mut out), Ok(None));
            prop_assert!(input.is_empty());
            prop_assert_eq!(out.to_vec(), want);
        }

        #[test]
        fn arbitrary_input_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut d = FrameDecoder::new(100);
            let mut input = BytesMut::from(&bytes[..]);
            let mut out = BytesMut::new();
            while let Ok(Some(_)) = d.decode(&mut input, &mut out) {}
        }
    }
}
