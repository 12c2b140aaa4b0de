//! Sans-IO HTTP/1.1 for the oneM2M transport (and the functions' HTTP sink): encoding
//! requests, and decoding the CSE's pipelined responses from a connection's receive buffer,
//! [`ResponseBuf`]. No socket, no clock: bytes in, responses out, so it is tested split at
//! every offset and fuzzed (`fuzz/fuzz_targets/onem2m_response.rs`).
//!
//! Decoding is incremental: the buffer remembers how far it got (searching for the head's
//! end, the current chunk-size line, how much of the current chunk is still to come), and
//! decoded bytes leave it, so each byte received is examined a bounded number of times
//! whatever the sizes of the reads ([`ResponseBuf::bytes_examined`] measures it; issue 28
//! finding 13: re-parsing from the start on each read made a body in many small reads cost
//! quadratic work).
//!
//! Wire format (RFC 9112, the subset a CSE answers with): a status line `HTTP/1.x NNN reason`,
//! header fields, then a body delimited by `Content-Length` or `Transfer-Encoding: chunked`
//! (chunk extensions ignored, trailers skipped), or empty for 1xx/204/304. `1xx` interim
//! responses are skipped. A response with neither length nor chunking is refused: with
//! pipelining only a delimited body can be told apart from the next response.
//!
//! Bounds: the head (status line and headers) at most [`MAX_HEAD_BYTES`] and
//! [`MAX_HEADERS`] fields, the body at most [`MAX_BODY_BYTES`], a chunk-size line at most
//! [`MAX_CHUNK_LINE_BYTES`], a chunked body's trailers at most [`MAX_HEAD_BYTES`] in all;
//! beyond, an error (the connection is closed — the CSE is to blame). Whether bytes are an
//! error does not depend on how they were split into reads: a bound is enforced as soon as
//! the bytes so far prove it will be crossed. Bytes that cannot start a response
//! (`HTTP/1.`) are refused at once. Decoding never panics on any input, and never allocates
//! more than the bytes it was given.
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

/// Longest chunk-size line (size and extensions) accepted.
pub const MAX_CHUNK_LINE_BYTES: usize = 1024;

/// The receive buffer of one connection and how far the decoder got through it.
///
/// Bytes are appended as they are read ([`ResponseBuf::extend_from_slice`]) and
/// [`ResponseBuf::decode`] picks up where the previous call stopped: a byte is examined a
/// bounded number of times whatever the read sizes (the head's end is searched once, each
/// chunk line once, body bytes are copied once), so a body arriving in many small reads
/// costs linear work. Decoded bytes leave the buffer as they are decoded: it holds at most
/// an unfinished head or chunk line plus what arrived after it; the body being collected is
/// held apart, within [`MAX_BODY_BYTES`].
///
/// After an error the buffer is in no useful state: the connection is closed and
/// [`ResponseBuf::clear`] called before it is used again.
pub struct ResponseBuf {
    buf: BytesMut,
    state: State,
    examined: u64,
}

enum State {
    /// Waiting for a complete head; no end of head starts before `buf[scanned]`.
    Head { scanned: usize },
    /// The head is decoded (and gone from the buffer); the body is being collected.
    Body {
        head: Head,
        body: BytesMut,
        at: BodyAt,
    },
}

enum BodyAt {
    /// `remaining` bytes of a `Content-Length` body still to come.
    Length { remaining: usize },
    /// The buffer starts with a chunk-size line; no CRLF starts before `buf[scanned]`.
    ChunkLine { scanned: usize },
    /// `remaining` bytes of the current chunk still to come.
    ChunkData { remaining: usize },
    /// The CRLF after a chunk's data.
    ChunkEnd,
    /// Trailer lines (`total` bytes of them so far); no CRLF starts before `buf[scanned]`.
    Trailers { scanned: usize, total: usize },
}

impl std::fmt::Debug for ResponseBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = match &self.state {
            State::Head { .. } => "head",
            State::Body { .. } => "body",
        };
        f.debug_struct("ResponseBuf")
            .field("unparsed", &self.buf.len())
            .field("at", &at)
            .finish()
    }
}

impl Default for ResponseBuf {
    fn default() -> ResponseBuf {
        ResponseBuf::new()
    }
}

impl ResponseBuf {
    pub fn new() -> ResponseBuf {
        ResponseBuf {
            buf: BytesMut::new(),
            state: State::Head { scanned: 0 },
            examined: 0,
        }
    }

    /// Append bytes read from the connection.
    pub fn extend_from_slice(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The bytes not decoded yet, to read into (`read_buf`) or to take over after
    /// [`HttpError::Undelimited`] (the final response's head is still there, whole).
    /// Only append: the decoder remembers positions in these bytes.
    pub fn unparsed_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// Forget every byte and any response in progress (the connection was closed).
    pub fn clear(&mut self) {
        self.buf.clear();
        self.state = State::Head { scanned: 0 };
    }

    /// Bytes received and not decoded yet (the body being collected is not counted).
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// How many bytes the decoder has looked at since this buffer was made (searches for a
    /// line's end, header parsing, body copies): the measure of its work, linear in the bytes
    /// received whatever their split into reads.
    pub fn bytes_examined(&self) -> u64 {
        self.examined
    }

    /// Decode the next complete response. `Ok(None)`: more bytes are needed (what could be
    /// decoded so far — interim 1xx responses, the head, whole chunks — is consumed and
    /// remembered; the next call continues from there).
    pub fn decode(&mut self) -> Result<Option<Response>, HttpError> {
        let ResponseBuf {
            buf,
            state,
            examined,
        } = self;
        loop {
            match state {
                State::Head { scanned } => {
                    let Some((head_len, head)) = next_head(buf, scanned, examined)? else {
                        return Ok(None);
                    };
                    buf.advance(head_len);
                    *scanned = 0;
                    if (100..200).contains(&head.status) {
                        continue;
                    }
                    let at = match head.framing {
                        Framing::Empty => return Ok(Some(head.into_response(Bytes::new()))),
                        // n ≤ MAX_BODY_BYTES, checked in parse_head.
                        Framing::Length(n) => BodyAt::Length {
                            remaining: n as usize,
                        },
                        Framing::Chunked => BodyAt::ChunkLine { scanned: 0 },
                    };
                    *state = State::Body {
                        head,
                        body: BytesMut::new(),
                        at,
                    };
                }
                State::Body { body, at, .. } => {
                    if !body_step(buf, body, at, examined)? {
                        return Ok(None);
                    }
                    if let State::Body { head, body, .. } =
                        std::mem::replace(state, State::Head { scanned: 0 })
                    {
                        return Ok(Some(head.into_response(body.freeze())));
                    }
                }
            }
        }
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

impl Head {
    fn into_response(self, body: Bytes) -> Response {
        Response {
            status: self.status,
            rsc: self.rsc,
            ri: self.ri,
            close: self.close,
            content_type: self.content_type,
            body,
        }
    }
}

/// How every response starts (after optional empty lines).
const STATUS_PREFIX: &[u8] = b"HTTP/1.";

/// Parse a head that ends `buf`: `Ok(None)` when httparse wants more.
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

/// The next head at the start of `buf` (after any empty lines, which are dropped), once it
/// is complete: `Some((its length, the head))`. Searches for the head's end from `scanned`
/// on, and leaves in `scanned` where the next search starts.
fn next_head(
    buf: &mut BytesMut,
    scanned: &mut usize,
    examined: &mut u64,
) -> Result<Option<(usize, Head)>, HttpError> {
    if *scanned == 0 {
        // RFC 9112 §2.2: empty lines before a message are ignored.
        loop {
            if buf.first() == Some(&b'\n') {
                buf.advance(1);
            } else if buf.starts_with(b"\r\n") {
                buf.advance(2);
            } else {
                break;
            }
            *examined += 1;
        }
        if buf[..] == b"\r"[..] {
            return Ok(None);
        }
    }
    // Refuse what is not a response at once rather than after a timeout, until the whole
    // prefix has been seen (once a search went past it, it was checked whole), so the
    // verdict does not depend on how the bytes were split into reads.
    if *scanned < STATUS_PREFIX.len() {
        let n = buf.len().min(STATUS_PREFIX.len());
        *examined += n as u64;
        if buf[..n] != STATUS_PREFIX[..n] {
            return Err(HttpError::BadHead("not an HTTP/1.x response"));
        }
    }
    loop {
        // Past the bound no acceptable head can end: look no further.
        let window = &buf[..buf.len().min(MAX_HEAD_BYTES + 3)];
        let Some(end) = find_head_end(window, scanned, examined) else {
            // The head, when it ends, is longer than what is here.
            if buf.len() >= MAX_HEAD_BYTES {
                return Err(HttpError::HeadTooLarge);
            }
            return Ok(None);
        };
        *examined += end as u64;
        if let Some(done) = parse_head(&buf[..end])? {
            return Ok(Some(done));
        }
        // Not the head's end after all (httparse wants more): search on from past it.
    }
}

/// The end of a head (just past `LF LF` or `LF CR LF`) in `buf`, searching from `*scanned`.
/// Leaves `*scanned` where the next search starts: past this line feed when an end is
/// found (so a search after it moves on), else at the last line feed whose followers have
/// not arrived yet, or at the end.
fn find_head_end(buf: &[u8], scanned: &mut usize, examined: &mut u64) -> Option<usize> {
    let mut i = *scanned;
    while let Some(off) = buf
        .get(i..)
        .and_then(|rest| rest.iter().position(|&b| b == b'\n'))
    {
        let lf = i + off;
        *examined += off as u64 + 1;
        match (buf.get(lf + 1), buf.get(lf + 2)) {
            (Some(b'\n'), _) => {
                *scanned = lf + 1;
                return Some(lf + 2);
            }
            (Some(b'\r'), Some(b'\n')) => {
                *scanned = lf + 1;
                return Some(lf + 3);
            }
            (None, _) | (Some(b'\r'), None) => {
                *scanned = lf;
                return None;
            }
            _ => i = lf + 1,
        }
    }
    *scanned = buf.len().max(i);
    None
}

/// Collect body bytes from `buf` into `body` as far as they go: `Ok(true)` when the body is
/// complete (its bytes, and for chunking its trailers, consumed), `Ok(false)` when more
/// bytes are needed.
fn body_step(
    buf: &mut BytesMut,
    body: &mut BytesMut,
    at: &mut BodyAt,
    examined: &mut u64,
) -> Result<bool, HttpError> {
    loop {
        match at {
            BodyAt::Length { remaining } | BodyAt::ChunkData { remaining } => {
                let n = (*remaining).min(buf.len());
                body.extend_from_slice(&buf[..n]);
                buf.advance(n);
                *examined += n as u64;
                *remaining -= n;
                if *remaining > 0 {
                    return Ok(false);
                }
                if matches!(at, BodyAt::Length { .. }) {
                    return Ok(true);
                }
                *at = BodyAt::ChunkEnd;
            }
            BodyAt::ChunkEnd => {
                if buf.len() < 2 {
                    return Ok(false);
                }
                *examined += 2;
                if &buf[..2] != b"\r\n" {
                    return Err(HttpError::BadChunk);
                }
                buf.advance(2);
                *at = BodyAt::ChunkLine { scanned: 0 };
            }
            BodyAt::ChunkLine { scanned } => {
                let Some(line_end) = find_crlf_from(buf, scanned, examined) else {
                    // The line, when it ends, is at least this long (less a trailing CR).
                    if buf.len().saturating_sub(1) > MAX_CHUNK_LINE_BYTES {
                        return Err(HttpError::BadChunk);
                    }
                    return Ok(false);
                };
                if line_end > MAX_CHUNK_LINE_BYTES {
                    return Err(HttpError::BadChunk);
                }
                let size = chunk_size(&buf[..line_end])?;
                buf.advance(line_end + 2);
                if size == 0 {
                    *at = BodyAt::Trailers {
                        scanned: 0,
                        total: 0,
                    };
                } else if body.len() + size > MAX_BODY_BYTES {
                    return Err(HttpError::BodyTooLarge((body.len() + size) as u64));
                } else {
                    *at = BodyAt::ChunkData { remaining: size };
                }
            }
            BodyAt::Trailers { scanned, total } => {
                let Some(end) = find_crlf_from(buf, scanned, examined) else {
                    // This line will take at least one byte more than is here.
                    if *total + buf.len() + 1 > MAX_HEAD_BYTES {
                        return Err(HttpError::HeadTooLarge);
                    }
                    return Ok(false);
                };
                *total += end + 2;
                if *total > MAX_HEAD_BYTES {
                    return Err(HttpError::HeadTooLarge);
                }
                buf.advance(end + 2);
                if end == 0 {
                    return Ok(true);
                }
                *scanned = 0;
            }
        }
    }
}

/// The size on a chunk-size line (extensions after `;` ignored).
fn chunk_size(line: &[u8]) -> Result<usize, HttpError> {
    let size_text = line
        .split(|&b| b == b';')
        .next()
        .unwrap_or(line)
        .trim_ascii();
    if size_text.is_empty() || size_text.len() > 8 {
        return Err(HttpError::BadChunk);
    }
    std::str::from_utf8(size_text)
        .ok()
        .and_then(|s| usize::from_str_radix(s, 16).ok())
        .ok_or(HttpError::BadChunk)
}

/// The first CRLF in `buf` at or after `*scanned`; when none, leaves in `*scanned` where the
/// next search starts (a trailing CR is looked at again).
fn find_crlf_from(buf: &[u8], scanned: &mut usize, examined: &mut u64) -> Option<usize> {
    let from = *scanned;
    let rest = buf.get(from..).unwrap_or_default();
    match rest.windows(2).position(|w| w == b"\r\n") {
        Some(p) => {
            *examined += p as u64 + 2;
            Some(from + p)
        }
        None => {
            *examined += rest.len() as u64;
            *scanned = buf.len().saturating_sub(1).max(from);
            None
        }
    }
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

    fn buf_of(bytes: &[u8]) -> ResponseBuf {
        let mut buf = ResponseBuf::new();
        buf.extend_from_slice(bytes);
        buf
    }

    fn decode_all(bytes: &[u8]) -> Result<Vec<Response>, HttpError> {
        let mut buf = buf_of(bytes);
        let mut out = Vec::new();
        while let Some(r) = buf.decode()? {
            out.push(r);
        }
        assert!(buf.is_empty(), "left over: {} bytes", buf.len());
        Ok(out)
    }

    /// Every response `pieces` decode to, fed one after the other, and whether decoding
    /// failed.
    fn decode_pieces<'a>(
        pieces: impl IntoIterator<Item = &'a [u8]>,
    ) -> (Vec<Response>, Option<HttpError>) {
        let mut buf = ResponseBuf::new();
        let mut out = Vec::new();
        for piece in pieces {
            buf.extend_from_slice(piece);
            loop {
                match buf.decode() {
                    Ok(Some(r)) => out.push(r),
                    Ok(None) => break,
                    Err(e) => return (out, Some(e)),
                }
            }
        }
        (out, None)
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
            let (got, error) = decode_pieces([&stream[..split], &stream[split..]]);
            assert_eq!(error, None, "split at {split}");
            assert_eq!(got, whole, "split at {split}");
        }
        // And one byte per read, as a slow CSE might send it.
        let (got, error) = decode_pieces(stream.chunks(1));
        assert_eq!((got, error), (whole, None));
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
        assert_eq!(buf_of(&long).decode(), Err(HttpError::HeadTooLarge));
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

    #[test]
    fn a_chunked_body_arriving_one_byte_per_read_is_examined_a_bounded_number_of_times() {
        let body: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        let wire = encode(201, Some(2001), &body, Some(16), false);
        let mut rb = ResponseBuf::new();
        let mut got = None;
        for b in &wire {
            rb.extend_from_slice(std::slice::from_ref(b));
            if let Some(r) = rb.decode().unwrap() {
                got = Some(r);
            }
        }
        assert_eq!(got.expect("decoded").body, Bytes::from(body));
        let examined = rb.bytes_examined();
        println!(
            "wire {} bytes in 1-byte reads: {examined} bytes examined",
            wire.len()
        );
        assert!(
            examined <= 4 * wire.len() as u64,
            "{examined} bytes examined for {} bytes of wire: parse work is not linear",
            wire.len()
        );
    }

    #[test]
    fn a_chunked_body_split_at_every_offset_decodes_as_in_one_piece() {
        let body: Vec<u8> = (0..300u32).map(|i| (i * 7 % 256) as u8).collect();
        let mut wire = encode(200, Some(2000), &body, Some(13), false);
        // Leading empty lines, an interim response, and a second chunked response behind.
        wire.splice(0..0, b"\r\n\nHTTP/1.1 100 Continue\r\n\r\n".iter().copied());
        wire.extend(encode(201, Some(2001), b"second", Some(1), true));
        let (whole, error) = decode_pieces([&wire[..]]);
        assert_eq!(error, None);
        assert_eq!(whole.len(), 2);
        assert_eq!(whole[0].body, Bytes::from(body));
        assert_eq!(whole[1].body, Bytes::from_static(b"second"));
        for split in 0..=wire.len() {
            assert_eq!(
                decode_pieces([&wire[..split], &wire[split..]]),
                (whole.clone(), None),
                "split at {split}"
            );
        }
        for size in 1..8 {
            assert_eq!(
                decode_pieces(wire.chunks(size)),
                (whole.clone(), None),
                "{size}-byte reads"
            );
        }
    }

    #[test]
    fn chunked_bounds_hold_whatever_the_split() {
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
        // A chunk-size line longer than MAX_CHUNK_LINE_BYTES.
        let mut long_line = chunked.to_vec();
        long_line.extend(b"1;");
        long_line.extend(std::iter::repeat_n(b'x', MAX_CHUNK_LINE_BYTES));
        long_line.extend(b"\r\na\r\n0\r\n\r\n");
        // Chunks adding up to more than MAX_BODY_BYTES.
        let mut too_big = chunked.to_vec();
        too_big.extend(format!("{:x}\r\n", MAX_BODY_BYTES).as_bytes());
        too_big.extend(std::iter::repeat_n(b'a', MAX_BODY_BYTES));
        too_big.extend(b"\r\n1\r\n");
        // Trailers adding up to more than MAX_HEAD_BYTES, in short lines.
        let mut trailers = chunked.to_vec();
        trailers.extend(b"0\r\n");
        for _ in 0..(MAX_HEAD_BYTES / 8 + 1) {
            trailers.extend(b"T: 1234\r\n");
        }
        for (name, wire, want) in [
            ("long chunk line", &long_line, HttpError::BadChunk),
            (
                "body too large",
                &too_big,
                HttpError::BodyTooLarge(MAX_BODY_BYTES as u64 + 1),
            ),
            ("trailers too large", &trailers, HttpError::HeadTooLarge),
        ] {
            assert_eq!(decode_pieces([&wire[..]]).1, Some(want.clone()), "{name}");
            for size in [1, 2, 3, 1000] {
                assert_eq!(
                    decode_pieces(wire.chunks(size)).1,
                    Some(want.clone()),
                    "{name} in {size}-byte reads"
                );
            }
        }
    }

    #[test]
    fn decoded_bytes_leave_the_buffer_as_they_are_decoded() {
        let body = vec![b'z'; 4096];
        let wire = encode(200, None, &body, Some(100), false);
        let mut buf = ResponseBuf::new();
        let mut most = 0;
        for piece in wire.chunks(50) {
            buf.extend_from_slice(piece);
            let _ = buf.decode().unwrap();
            most = most.max(buf.len());
        }
        assert!(most < 64, "the receive buffer held {most} bytes");
    }

    proptest! {
        #[test]
        fn any_bytes_decode_without_panicking(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let mut buf = buf_of(&data);
            for _ in 0..64 {
                match buf.decode() {
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
            let mut buf = buf_of(&wire[..split]);
            let first = buf.decode().unwrap();
            let r = match first {
                Some(r) => r,
                None => {
                    buf.extend_from_slice(&wire[split..]);
                    buf.decode().unwrap().expect("complete")
                }
            };
            prop_assert_eq!(r.status, status);
            prop_assert_eq!(r.rsc, rsc);
            prop_assert_eq!(r.close, close);
            prop_assert_eq!(&r.body[..], &want_body[..]);
        }

        #[test]
        fn any_bytes_give_the_same_verdict_whole_and_in_pieces(
            data in proptest::collection::vec(
                prop_oneof![
                    Just(b'\r'), Just(b'\n'), Just(b'0'), Just(b'a'), Just(b';'), any::<u8>(),
                ],
                0..512,
            ),
            prefix in prop_oneof![
                Just(&b""[..]),
                Just(&b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"[..]),
                Just(&b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"[..]),
            ],
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let wire: Vec<u8> = prefix.iter().chain(&data).copied().collect();
            let mut at: Vec<usize> = cuts.iter().map(|c| c.index(wire.len() + 1)).collect();
            at.push(0);
            at.push(wire.len());
            at.sort_unstable();
            let pieces = at.windows(2).map(|w| &wire[w[0]..w[1]]);
            let (whole, werr) = decode_pieces([&wire[..]]);
            let (split, serr) = decode_pieces(pieces);
            prop_assert_eq!(&whole, &split);
            prop_assert_eq!(werr.is_some(), serr.is_some());
            // One byte per read: the same, and work linear in the input (the bound the fuzz
            // target asserts).
            let mut buf = ResponseBuf::new();
            let (mut got, mut calls, mut failed) = (Vec::new(), 0u64, false);
            'feed: for b in &wire {
                buf.extend_from_slice(std::slice::from_ref(b));
                loop {
                    calls += 1;
                    match buf.decode() {
                        Ok(Some(r)) => got.push(r),
                        Ok(None) => break,
                        Err(_) => {
                            failed = true;
                            break 'feed;
                        }
                    }
                }
            }
            prop_assert_eq!(&got, &whole);
            prop_assert_eq!(failed, werr.is_some());
            prop_assert!(
                buf.bytes_examined() <= 2 * wire.len() as u64 + 16 * calls,
                "{} examined for {} bytes in {} calls", buf.bytes_examined(), wire.len(), calls
            );
        }

        #[test]
        fn work_is_linear_in_the_bytes_received_whatever_the_reads(
            body in proptest::collection::vec(any::<u8>(), 0..2000),
            chunk in 1usize..40,
            read in 1usize..16,
        ) {
            let wire = encode(200, Some(2000), &body, Some(chunk), false);
            let mut buf = ResponseBuf::new();
            let mut got = None;
            for piece in wire.chunks(read) {
                buf.extend_from_slice(piece);
                if let Some(r) = buf.decode().unwrap() {
                    got = Some(r);
                }
            }
            prop_assert_eq!(&got.expect("decoded").body[..], &body[..]);
            prop_assert!(buf.bytes_examined() <= 4 * wire.len() as u64, "{} examined for {}", buf.bytes_examined(), wire.len());
        }
    }
}
