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
//! responses are skipped, except `101 Switching Protocols`: no request here asks for an
//! upgrade, and after a 101 the connection no longer speaks HTTP/1.1, so it is an error. A
//! response with neither length nor chunking is refused: with pipelining only a delimited
//! body can be told apart from the next response.
//!
//! A connection that carries one request at a time (the functions' HTTP sink,
//! [`ResponseBuf::one_at_a_time`]) also accepts a body delimited by the connection's close
//! (RFC 9112 §6.3 rule 8): it is collected as it arrives, within [`MAX_BODY_BYTES`], and
//! [`ResponseBuf::finish`] completes it when the server closes; such a response, and any
//! HTTP/1.0 one, always closes the connection.
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
    #[error("101 Switching Protocols to a request that asked for no upgrade")]
    Upgrade,
    #[error("the connection closed in the middle of a response")]
    Truncated,
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
    /// One request at a time on the connection: a body may run to the close, HTTP/1.0
    /// always closes ([`ResponseBuf::one_at_a_time`]).
    single: bool,
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
    /// A body that ends when the connection closes (only [`ResponseBuf::one_at_a_time`]).
    UntilClose,
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
            single: false,
        }
    }

    /// The receive buffer of a connection that carries one request at a time (no
    /// pipelining): a response with neither `Content-Length` nor chunking has a body that runs
    /// until the server closes ([`ResponseBuf::finish`] completes it), and an HTTP/1.0
    /// response always closes the connection (keep-alive or not).
    pub fn one_at_a_time() -> ResponseBuf {
        ResponseBuf {
            single: true,
            ..ResponseBuf::new()
        }
    }

    /// The server closed the connection (end of stream): the response whose body runs to the
    /// close, complete now; `Ok(None)` when no byte of a response had arrived;
    /// [`HttpError::Truncated`] when a response was cut short. Call after
    /// [`ResponseBuf::decode`] returned `Ok(None)`.
    pub fn finish(&mut self) -> Result<Option<Response>, HttpError> {
        match std::mem::replace(&mut self.state, State::Head { scanned: 0 }) {
            State::Body {
                head,
                body,
                at: BodyAt::UntilClose,
            } => {
                let mut r = head.into_response(body.freeze());
                r.close = true;
                Ok(Some(r))
            }
            State::Head { .. } if self.buf.iter().all(|&b| b == b'\r' || b == b'\n') => {
                self.buf.clear();
                Ok(None)
            }
            _ => Err(HttpError::Truncated),
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
            single,
        } = self;
        loop {
            match state {
                State::Head { scanned } => {
                    let Some((head_len, mut head)) = next_head(buf, scanned, examined, *single)?
                    else {
                        return Ok(None);
                    };
                    buf.advance(head_len);
                    *scanned = 0;
                    if head.status == 101 {
                        return Err(HttpError::Upgrade);
                    }
                    if (100..200).contains(&head.status) {
                        continue;
                    }
                    if *single && head.http10 {
                        head.close = true;
                    }
                    let at = match head.framing {
                        Framing::Empty => return Ok(Some(head.into_response(Bytes::new()))),
                        // n ≤ MAX_BODY_BYTES, checked in parse_head.
                        Framing::Length(n) => BodyAt::Length {
                            remaining: n as usize,
                        },
                        Framing::Chunked => BodyAt::ChunkLine { scanned: 0 },
                        Framing::UntilClose => {
                            head.close = true;
                            BodyAt::UntilClose
                        }
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
    /// Until the connection closes (only when `parse_head` is told the connection carries
    /// one request at a time).
    UntilClose,
}

struct Head {
    status: u16,
    http10: bool,
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
/// `single`: the connection carries one request at a time, so an undelimited body runs to
/// the close.
fn parse_head(buf: &[u8], single: bool) -> Result<Option<(usize, Head)>, HttpError> {
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
    } else if single {
        Framing::UntilClose
    } else {
        return Err(HttpError::Undelimited);
    };
    Ok(Some((
        head_len,
        Head {
            status,
            http10,
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
    single: bool,
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
        if let Some(done) = parse_head(&buf[..end], single)? {
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
            BodyAt::UntilClose => {
                let n = buf.len();
                if body.len() + n > MAX_BODY_BYTES {
                    return Err(HttpError::BodyTooLarge((body.len() + n) as u64));
                }
                body.extend_from_slice(buf);
                buf.clear();
                *examined += n as u64;
                return Ok(false);
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
mod tests;
