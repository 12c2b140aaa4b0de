//! Sans-IO HTTP/1.1 for the oneM2M transport: encoding requests, and decoding the CSE's
//! pipelined responses from a byte buffer. No socket, no clock: bytes in, responses out, so it
//! is tested split at every offset and fuzzed (`fuzz/fuzz_targets/onem2m_response.rs`).
//!
//! Wire format (RFC 9112, the subset a CSE answers with): a status line `HTTP/1.x NNN reason`,
//! header fields, then a body delimited by `Content-Length` or `Transfer-Encoding: chunked`
//! (chunk extensions ignored, trailers skipped), or empty for 1xx/204/304. `1xx` interim
//! responses are skipped. A response with neither length nor chunking is refused: with
//! pipelining only a delimited body can be told apart from the next response.
//!
//! Bounds: the head (status line and headers) at most [`MAX_HEAD_BYTES`] and
//! [`MAX_HEADERS`] fields, the body at most [`MAX_BODY_BYTES`]; beyond, an error (the
//! connection is closed — the CSE is to blame). Decoding never panics on any input, and never
//! allocates more than the bytes it was given.
//!
//! Of the head, only what the transport needs is kept: the status, `X-M2M-RSC` (a decimal
//! number, absent or malformed → `None`), `X-M2M-RI`, and whether the server will close the
//! connection after this response (`Connection: close`, or HTTP/1.0 without keep-alive).

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Longest response head accepted.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Most header fields in one response.
pub const MAX_HEADERS: usize = 64;
/// Largest response body accepted (a created resource is echoed unless `rcn=0`).
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// Why the CSE's bytes are not an acceptable HTTP/1.1 response.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    #[error("malformed response head: {0}")]
    BadHead(&'static str),
    #[error("response head larger than {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    #[error("response body of {0} bytes exceeds {MAX_BODY_BYTES}")]
    BodyTooLarge(u64),
    #[error("malformed Content-Length")]
    BadContentLength,
    #[error("unsupported Transfer-Encoding (only chunked is understood)")]
    UnsupportedTransferEncoding,
    #[error("malformed chunked body")]
    BadChunk,
    #[error("response body without Content-Length or chunking cannot be pipelined")]
    Undelimited,
}

/// One decoded response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    /// `X-M2M-RSC`, when present and a number.
    pub rsc: Option<u32>,
    /// `X-M2M-RI`, when present.
    pub ri: Option<Bytes>,
    /// The server closes the connection after this response.
    pub close: bool,
    /// `Content-Type`, when present.
    pub content_type: Option<Bytes>,
    pub body: Bytes,
}

/// Decode the first complete response in `buf` and remove its bytes. `Ok(None)`: more bytes
/// are needed; nothing was removed but whole interim 1xx responses, which are consumed and
/// skipped whether or not a final response follows in `buf` yet.
pub fn decode(buf: &mut BytesMut) -> Result<Option<Response>, HttpError> {
    loop {
        let Some((head_len, head)) = parse_head(buf)? else {
            return Ok(None);
        };
        if (100..200).contains(&head.status) {
            buf.advance(head_len);
            continue;
        }
        let rest = &buf[head_len..];
        let (body, used) = match head.framing {
            Framing::Empty => (Bytes::new(), 0),
            Framing::Length(n) => {
                if (rest.len() as u64) < n {
                    return Ok(None);
                }
                // n ≤ MAX_BODY_BYTES, checked in parse_head.
                let n = n as usize;
                (Bytes::copy_from_slice(&rest[..n]), n)
            }
            Framing::Chunked => match dechunk(rest)? {
                Some(done) => done,
                None => return Ok(None),
            },
        };
        buf.advance(head_len + used);
        return Ok(Some(Response {
            status: head.status,
            rsc: head.rsc,
            ri: head.ri,
            close: head.close,
            content_type: head.content_type,
            body,
        }));
    }
}

enum Framing {
    Empty,
    Length(u64),
    Chunked,
}

struct Head {
    status: u16,
    rsc: Option<u32>,
    ri: Option<Bytes>,
    close: bool,
    content_type: Option<Bytes>,
    framing: Framing,
}

fn parse_head(buf: &[u8]) -> Result<Option<(usize, Head)>, HttpError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut res = httparse::Response::new(&mut headers);
    let head_len = match res.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            if buf.len() > MAX_HEAD_BYTES {
                return Err(HttpError::HeadTooLarge);
            }
            return Ok(None);
        }
        Err(httparse::Error::TooManyHeaders) => return Err(HttpError::BadHead("too many headers")),
        Err(_) => return Err(HttpError::BadHead("not an HTTP/1.x response")),
    };
    if head_len > MAX_HEAD_BYTES {
        return Err(HttpError::HeadTooLarge);
    }
    let status = res.code.ok_or(HttpError::BadHead("no status"))?;
    let http10 = res.version == Some(0);
    let mut rsc = None;
    let mut ri = None;
    let mut content_type = None;
    let mut close = http10;
    let mut length: Option<u64> = None;
    let mut chunked = false;
    for h in res.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("x-m2m-rsc") {
            rsc = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse::<u32>().ok());
        } else if name.eq_ignore_ascii_case("x-m2m-ri") {
            ri = Some(Bytes::copy_from_slice(h.value));
        } else if name.eq_ignore_ascii_case("content-type") {
            content_type = Some(Bytes::copy_from_slice(h.value.trim_ascii()));
        } else if name.eq_ignore_ascii_case("connection") {
            for token in h.value.split(|&b| b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") && http10 {
                    close = false;
                }
            }
        } else if name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(h.value)
                .ok()
                .map(str::trim)
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or(HttpError::BadContentLength)?;
            if length.is_some_and(|l| l != n) {
                return Err(HttpError::BadContentLength);
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            let v = h.value.trim_ascii();
            if v.eq_ignore_ascii_case(b"chunked") {
                chunked = true;
            } else if !v.eq_ignore_ascii_case(b"identity") {
                return Err(HttpError::UnsupportedTransferEncoding);
            }
        }
    }
    let framing = if (100..200).contains(&status) || status == 204 || status == 304 {
        Framing::Empty
    } else if chunked {
        Framing::Chunked
    } else if let Some(n) = length {
        if n > MAX_BODY_BYTES as u64 {
            return Err(HttpError::BodyTooLarge(n));
        }
        Framing::Length(n)
    } else {
        return Err(HttpError::Undelimited);
    };
    Ok(Some((
        head_len,
        Head {
            status,
            rsc,
            ri,
            close,
            content_type,
            framing,
        },
    )))
}

/// A chunked body at the start of `data`: `Some((body, bytes used))` when complete.
fn dechunk(data: &[u8]) -> Result<Option<(Bytes, usize)>, HttpError> {
    let mut pos = 0;
    let mut body = BytesMut::new();
    loop {
        let Some(line_end) = find_crlf(&data[pos..]) else {
            // A size line longer than any sane one is an error, not a wait.
            if data.len() - pos > 1024 {
                return Err(HttpError::BadChunk);
            }
            return Ok(None);
        };
        let line = &data[pos..pos + line_end];
        let size_text = line
            .split(|&b| b == b';')
            .next()
            .unwrap_or(line)
            .trim_ascii();
        if size_text.is_empty() || size_text.len() > 8 {
            return Err(HttpError::BadChunk);
        }
        let size = std::str::from_utf8(size_text)
            .ok()
            .and_then(|s| usize::from_str_radix(s, 16).ok())
            .ok_or(HttpError::BadChunk)?;
        pos += line_end + 2;
        if size == 0 {
            // Trailers, then an empty line.
            loop {
                let Some(end) = find_crlf(&data[pos..]) else {
                    if data.len() - pos > MAX_HEAD_BYTES {
                        return Err(HttpError::HeadTooLarge);
                    }
                    return Ok(None);
                };
                pos += end + 2;
                if end == 0 {
                    return Ok(Some((body.freeze(), pos)));
                }
            }
        }
        if body.len() + size > MAX_BODY_BYTES {
            return Err(HttpError::BodyTooLarge((body.len() + size) as u64));
        }
        if data.len() < pos + size + 2 {
            return Ok(None);
        }
        body.extend_from_slice(&data[pos..pos + size]);
        if &data[pos + size..pos + size + 2] != b"\r\n" {
            return Err(HttpError::BadChunk);
        }
        pos += size + 2;
    }
}

fn find_crlf(data: &[u8]) -> Option<usize> {
    data.windows(2).position(|w| w == b"\r\n")
}

/// One oneM2M request over HTTP (see `onem2m-http.md` §2).
pub struct Request<'a> {
    pub method: &'static str,
    /// Path and query, already safe for a request target.
    pub target: &'a str,
    pub host: &'a str,
    pub origin: &'a str,
    /// `X-M2M-RI`.
    pub ri: &'a str,
    /// `Some(ty)`: a CREATE with `Content-Type: application/json;ty=N`.
    pub ty: Option<u8>,
    pub body: &'a [u8],
}

impl Request<'_> {
    /// Append the encoded request to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        out.reserve(256 + self.target.len() + self.body.len());
        for part in [
            self.method,
            " ",
            self.target,
            " HTTP/1.1\r\nHost: ",
            self.host,
            "\r\nX-M2M-Origin: ",
            self.origin,
            "\r\nX-M2M-RI: ",
            self.ri,
            "\r\nX-M2M-RVI: 3\r\nAccept: application/json\r\n",
        ] {
            out.put_slice(part.as_bytes());
        }
        if let Some(ty) = self.ty {
            out.put_slice(b"Content-Type: application/json;ty=");
            out.put_slice(ty.to_string().as_bytes());
            out.put_slice(b"\r\n");
        }
        if self.ty.is_some() || !self.body.is_empty() {
            out.put_slice(b"Content-Length: ");
            out.put_slice(self.body.len().to_string().as_bytes());
            out.put_slice(b"\r\n");
        }
        out.put_slice(b"\r\n");
        out.put_slice(self.body);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ACME_201: &[u8] = b"HTTP/1.1 201 CREATED\r\nX-M2M-RSC: 2001\r\nX-M2M-RI: req-cin-1\r\nX-M2M-RVI: 3\r\nContent-Type: application/json\r\nContent-Length: 0\r\n\r\n";

    /// Encode a response the way a server might (for round trips).
    fn encode(
        status: u16,
        rsc: Option<u32>,
        body: &[u8],
        chunks: Option<usize>,
        close: bool,
    ) -> Vec<u8> {
        let mut out = format!("HTTP/1.1 {status} X\r\n").into_bytes();
        if let Some(rsc) = rsc {
            out.extend_from_slice(format!("X-M2m-Rsc: {rsc}\r\n").as_bytes());
        }
        if close {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        match chunks {
            None => {
                out.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
                out.extend_from_slice(body);
            }
            Some(size) => {
                out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
                for c in body.chunks(size.max(1)) {
                    out.extend_from_slice(format!("{:x};ext=1\r\n", c.len()).as_bytes());
                    out.extend_from_slice(c);
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(b"0\r\nTrailer: x\r\n\r\n");
            }
        }
        out
    }

    fn decode_all(bytes: &[u8]) -> Result<Vec<Response>, HttpError> {
        let mut buf = BytesMut::from(bytes);
        let mut out = Vec::new();
        while let Some(r) = decode(&mut buf)? {
            out.push(r);
        }
        assert!(buf.is_empty(), "left over: {buf:?}");
        Ok(out)
    }

    #[test]
    fn acme_created_response_decodes_with_its_rsc_and_request_id() {
        let r = decode_all(ACME_201).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].status, r[0].rsc), (201, Some(2001)));
        assert_eq!(r[0].ri.as_deref(), Some(&b"req-cin-1"[..]));
        assert_eq!(r[0].content_type.as_deref(), Some(&b"application/json"[..]));
        assert!(!r[0].close);
    }

    #[test]
    fn pipelined_responses_split_at_every_offset_decode_the_same() {
        let mut stream = ACME_201.to_vec();
        stream.extend(encode(
            409,
            Some(4105),
            br#"{"m2m:dbg": "exists"}"#,
            None,
            false,
        ));
        stream.extend(b"HTTP/1.1 100 Continue\r\n\r\n");
        stream.extend(encode(
            404,
            Some(4004),
            b"not found, chunked",
            Some(5),
            true,
        ));
        let whole = decode_all(&stream).unwrap();
        assert_eq!(whole.len(), 3);
        assert_eq!(whole[2].body, Bytes::from_static(b"not found, chunked"));
        assert!(whole[2].close);
        for split in 0..=stream.len() {
            let mut buf = BytesMut::from(&stream[..split]);
            let mut got = Vec::new();
            while let Some(r) = decode(&mut buf).unwrap() {
                got.push(r);
            }
            buf.extend_from_slice(&stream[split..]);
            while let Some(r) = decode(&mut buf).unwrap() {
                got.push(r);
            }
            assert_eq!(got, whole, "split at {split}");
        }
    }

    #[test]
    fn bounds_and_malformed_heads_are_errors_not_waits() {
        let big = format!(
            "HTTP/1.1 201 X\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY_BYTES + 1
        );
        assert!(matches!(
            decode_all(big.as_bytes()),
            Err(HttpError::BodyTooLarge(_))
        ));
        let mut long = b"HTTP/1.1 201 X\r\nX-Pad: ".to_vec();
        long.extend(std::iter::repeat_n(b'a', MAX_HEAD_BYTES + 1));
        assert_eq!(
            decode(&mut BytesMut::from(&long[..])),
            Err(HttpError::HeadTooLarge)
        );
        assert!(
            decode_all(b"HTTP/1.1 200 OK\r\n\r\n").is_err(),
            "undelimited body"
        );
        assert!(decode_all(b"GARBAGE\r\n\r\n").is_err());
        assert!(decode_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n").is_err());
        assert!(decode_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n").is_err());
        assert!(
            decode_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").is_err()
        );
        let r = decode_all(b"HTTP/1.1 204 No\r\nX-M2M-RSC: x\r\n\r\n").unwrap();
        assert_eq!((r[0].status, r[0].rsc), (204, None));
        let r = decode_all(b"HTTP/1.0 201 X\r\nContent-Length: 0\r\n\r\n").unwrap();
        assert!(r[0].close, "HTTP/1.0 closes unless keep-alive");
    }

    #[test]
    fn requests_carry_the_onem2m_headers() {
        let mut out = BytesMut::new();
        Request {
            method: "POST",
            target: "/~/id-in/cse-in/gw",
            host: "127.0.0.1:8080",
            origin: "Cgw",
            ri: "s0n-1",
            ty: Some(4),
            body: b"{}",
        }
        .encode(&mut out);
        let text = std::str::from_utf8(&out).unwrap();
        assert!(text.starts_with("POST /~/id-in/cse-in/gw HTTP/1.1\r\n"));
        for h in [
            "X-M2M-Origin: Cgw\r\n",
            "X-M2M-RI: s0n-1\r\n",
            "X-M2M-RVI: 3\r\n",
            "Content-Type: application/json;ty=4\r\n",
            "Content-Length: 2\r\n",
        ] {
            assert!(text.contains(h), "{h}");
        }
        assert!(text.ends_with("\r\n\r\n{}"));
    }

    proptest! {
        #[test]
        fn any_bytes_decode_without_panicking(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let mut buf = BytesMut::from(&data[..]);
            for _ in 0..64 {
                match decode(&mut buf) {
                    Ok(Some(_)) => continue,
                    _ => break,
                }
            }
        }

        #[test]
        fn responses_round_trip_at_any_split(
            status in 200u16..600,
            rsc in proptest::option::of(1000u32..7000),
            body in proptest::collection::vec(any::<u8>(), 0..300),
            chunks in proptest::option::of(1usize..64),
            close: bool,
            split in 0usize..2000,
        ) {
            let wire = encode(status, rsc, &body, chunks, close);
            let want_body = if status == 204 || status == 304 { Vec::new() } else { body.clone() };
            let wire = if status == 204 || status == 304 {
                // No body on the wire for these.
                let mut w = format!("HTTP/1.1 {status} X\r\n").into_bytes();
                if let Some(rsc) = rsc { w.extend(format!("X-M2M-RSC: {rsc}\r\n").as_bytes()); }
                if close { w.extend(b"Connection: close\r\n"); }
                w.extend(b"\r\n");
                w
            } else { wire };
            let split = split.min(wire.len());
            let mut buf = BytesMut::from(&wire[..split]);
            let first = decode(&mut buf).unwrap();
            let r = match first {
                Some(r) => r,
                None => {
                    buf.extend_from_slice(&wire[split..]);
                    decode(&mut buf).unwrap().expect("complete")
                }
            };
            prop_assert_eq!(r.status, status);
            prop_assert_eq!(r.rsc, rsc);
            prop_assert_eq!(r.close, close);
            prop_assert_eq!(&r.body[..], &want_body[..]);
        }
    }
}
