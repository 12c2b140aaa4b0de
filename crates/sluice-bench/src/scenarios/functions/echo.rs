//! The two minimal edge functions the `functions` scenario measures sluice against, and the
//! reply both give.
//!
//! Owns: the compiled echo ([`serve`], the hidden `sluice-bench fn-echo` command), the Python
//! echo's text (`crates/sluice-bench/functions/echo.py`, written to a temporary directory at
//! run time by [`write_python_echo`]) and the parser of their reply ([`EchoReply::parse`]).
//! Does not own: starting them (sluice's local runtime does) or what is measured.
//!
//! Contract of both (sluice's local runtime, `config/function.rs` `SocketMode`): the listening
//! socket is fd 3 when `LISTEN_FDS` is set (sluice bound it and requests queue in its backlog
//! while the function starts), else the function binds `127.0.0.1:$PORT`. Every request is
//! answered `200` over HTTP/1.1 keep-alive; the body is one JSON object:
//! `{"recv_ns":N,"start_ns":N,"bytes":N}` — CLOCK_REALTIME nanoseconds when the request was
//! read whole, when the function's `main` began (the compiled one: first line of `main`; the
//! Python one: once its imports are done), and the request body's length.
//!
//! The compiled echo is std-only: one thread per connection (sluice keeps few, long-lived
//! connections per instance), `httparse` for the head, `Content-Length` bodies only (sluice
//! sends no chunked requests), at most [`MAX_REQUEST`] bytes per request (larger: 413 and the
//! connection is closed), every read and write blocking.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};

use crate::payload::unix_now_ns;

/// The Python echo, shipped in the crate.
pub const PYTHON_ECHO: &str = include_str!("../../../functions/echo.py");

/// Largest request (head + body) the compiled echo reads.
pub const MAX_REQUEST: usize = 1 << 20;

/// Write the Python echo into `dir` and return its path.
pub fn write_python_echo(dir: &Path) -> anyhow::Result<PathBuf> {
    let path = dir.join("echo.py");
    std::fs::write(&path, PYTHON_ECHO).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The listening socket: fd 3 when `LISTEN_FDS` is set, else a new one on `127.0.0.1:$PORT`.
pub fn listener_from_env() -> anyhow::Result<TcpListener> {
    if std::env::var_os("LISTEN_FDS").is_some() {
        // `listenfd` ignores the fds unless LISTEN_PID is ours; a launcher that cannot know
        // the pid before exec may leave it unset or stale, and the fd is ours either way.
        std::env::set_var("LISTEN_PID", std::process::id().to_string());
        let mut fds = listenfd::ListenFd::from_env();
        match fds
            .take_tcp_listener(0)
            .context("fd 3 is not a TCP listener")?
        {
            Some(l) => return Ok(l),
            None => bail!("LISTEN_FDS is set but fd 3 was not passed"),
        }
    }
    let port: u16 = std::env::var("PORT")
        .context("neither LISTEN_FDS nor PORT is set")?
        .parse()
        .context("PORT is not a port number")?;
    TcpListener::bind(("127.0.0.1", port)).with_context(|| format!("binding 127.0.0.1:{port}"))
}

/// `sluice-bench fn-echo`: serve on the socket from the environment until killed.
pub fn serve() -> anyhow::Result<()> {
    let start_ns = unix_now_ns();
    let listener = listener_from_env()?;
    serve_on(listener, start_ns)
}

/// Serve every connection of `listener` on its own thread.
pub fn serve_on(listener: TcpListener, start_ns: u64) -> anyhow::Result<()> {
    loop {
        let (tcp, _) = listener.accept().context("accepting a connection")?;
        std::thread::spawn(move || {
            let _ = connection(tcp, start_ns);
        });
    }
}

/// One keep-alive connection: answer each request until the peer closes or errs.
fn connection(mut tcp: TcpStream, start_ns: u64) -> std::io::Result<()> {
    let _ = tcp.set_nodelay(true);
    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    let mut chunk = [0u8; 16384];
    loop {
        // Answer every complete request in the buffer, then read more.
        while let Some(step) = take_request(&buf) {
            let (used, body_len, close) = match step {
                Request::Complete {
                    used,
                    body_len,
                    close,
                } => (used, body_len, close),
                Request::Bad => {
                    tcp.write_all(
                        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    )?;
                    return Ok(());
                }
            };
            let recv_ns = unix_now_ns();
            buf.drain(..used);
            let body =
                format!("{{\"recv_ns\":{recv_ns},\"start_ns\":{start_ns},\"bytes\":{body_len}}}");
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{}\r\n",
                body.len(),
                if close { "Connection: close\r\n" } else { "" }
            );
            let mut out = head.into_bytes();
            out.extend_from_slice(body.as_bytes());
            tcp.write_all(&out)?;
            if close {
                return Ok(());
            }
        }
        if buf.len() >= MAX_REQUEST {
            tcp.write_all(
                b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            )?;
            return Ok(());
        }
        let n = tcp.read(&mut chunk)?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// What [`take_request`] found at the start of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Request {
    /// A whole request of `used` bytes with a body of `body_len`; `close`: the client asked
    /// for `Connection: close`.
    Complete {
        used: usize,
        body_len: usize,
        close: bool,
    },
    /// Not HTTP/1.x, or a `Content-Length` that is not a number.
    Bad,
}

/// The first request in `buf`, or `None` while it is incomplete.
fn take_request(buf: &[u8]) -> Option<Request> {
    if buf.is_empty() {
        return None;
    }
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let head = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return None,
        Err(_) => return Some(Request::Bad),
    };
    let mut body_len = 0usize;
    let mut close = req.version == Some(0);
    for h in req.headers.iter() {
        let value = std::str::from_utf8(h.value).unwrap_or("").trim();
        if h.name.eq_ignore_ascii_case("content-length") {
            match value.parse() {
                Ok(n) => body_len = n,
                Err(_) => return Some(Request::Bad),
            }
        } else if h.name.eq_ignore_ascii_case("connection") {
            close = value.eq_ignore_ascii_case("close");
        }
    }
    if head.saturating_add(body_len) > MAX_REQUEST {
        return Some(Request::Bad);
    }
    (buf.len() >= head + body_len).then_some(Request::Complete {
        used: head + body_len,
        body_len,
        close,
    })
}

/// What an echo answered (its JSON body).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
pub struct EchoReply {
    /// CLOCK_REALTIME ns when the function had read the request.
    pub recv_ns: u64,
    /// CLOCK_REALTIME ns when the function's `main` began.
    pub start_ns: u64,
    /// The request body's length.
    pub bytes: u64,
}

impl EchoReply {
    /// Parse a reply body; `None` if it is not an echo's.
    pub fn parse(body: &[u8]) -> Option<EchoReply> {
        serde_json::from_slice(body).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead as _;
    use std::time::Duration;

    /// Send `req`, read one response: status, body.
    fn exchange(tcp: &mut std::io::BufReader<TcpStream>, req: &[u8]) -> (u16, Vec<u8>) {
        tcp.get_mut().write_all(req).unwrap();
        let mut status = String::new();
        tcp.read_line(&mut status).unwrap();
        let code = status.split_whitespace().nth(1).unwrap().parse().unwrap();
        let mut len = 0;
        loop {
            let mut line = String::new();
            tcp.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; len];
        tcp.read_exact(&mut body).unwrap();
        (code, body)
    }

    fn post(body: &str) -> Vec<u8> {
        format!(
            "POST / HTTP/1.1\r\nHost: x\r\nce-specversion: 1.0\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }

    #[test]
    fn the_compiled_echo_answers_pipelined_posts_on_one_keep_alive_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let started = unix_now_ns();
        std::thread::spawn(move || serve_on(listener, started));
        let tcp = TcpStream::connect(addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut tcp = std::io::BufReader::new(tcp);
        let mut two = post("hello");
        two.extend(post("wörld!"));
        tcp.get_mut().write_all(&two[..7]).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let (code, body) = exchange(&mut tcp, &two[7..]);
        assert_eq!(code, 200);
        let reply = EchoReply::parse(&body).expect("an echo reply");
        assert_eq!((reply.start_ns, reply.bytes), (started, 5));
        assert!(reply.recv_ns >= started);
        // the second, pipelined, answer is already on its way
        let mut status = String::new();
        tcp.read_line(&mut status).unwrap();
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    }

    #[test]
    fn requests_split_anywhere_are_taken_only_once_whole() {
        let req = post("0123456789");
        for cut in 0..req.len() {
            assert_eq!(take_request(&req[..cut]), None, "cut at {cut}");
        }
        assert_eq!(
            take_request(&req),
            Some(Request::Complete {
                used: req.len(),
                body_len: 10,
                close: false
            })
        );
        assert_eq!(
            take_request(b"\x16\x03\x01 tls\r\n\r\n"),
            Some(Request::Bad)
        );
        let huge = format!("POST / HTTP/1.1\r\nContent-Length: {}\r\n\r\n", MAX_REQUEST);
        assert_eq!(take_request(huge.as_bytes()), Some(Request::Bad));
    }

    /// Bind a listening socket, hand it to `program` as fd 3 with LISTEN_FDS=1 (a python3
    /// launcher does the dup2 and exec: std cannot without `unsafe`), or with `fd3 = false`
    /// only set PORT; return the child and the port.
    fn launch(program: &[&str], fd3: bool) -> (std::process::Child, u16) {
        const LAUNCHER: &str = "import os,socket,sys\n\
            fd3 = sys.argv[1] == '1'\n\
            s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
            s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]\n\
            env = dict(os.environ, PORT=str(port))\n\
            if fd3:\n    s.listen(128); os.dup2(s.fileno(), 3); os.set_inheritable(3, True); env['LISTEN_FDS'] = '1'\n\
            else:\n    s.close(); env.pop('LISTEN_FDS', None)\n\
            print(port, flush=True)\n\
            os.execvpe(sys.argv[2], sys.argv[2:], env)\n";
        let mut child = std::process::Command::new("python3")
            .args(["-c", LAUNCHER, if fd3 { "1" } else { "0" }])
            .args(program)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        (child, line.trim().parse().unwrap())
    }

    fn python3_present() -> bool {
        std::process::Command::new("python3")
            .arg("--version")
            .output()
            .is_ok()
    }

    /// Two posts on one connection to 127.0.0.1:`port`, retried while the function starts.
    fn two_posts(port: u16) -> Vec<EchoReply> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let tcp = loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(t) => break t,
                Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => panic!("the echo never listened: {e}"),
            }
        };
        tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut tcp = std::io::BufReader::new(tcp);
        ["a", "bc"]
            .iter()
            .map(|body| {
                let (code, reply) = exchange(&mut tcp, &post(body));
                assert_eq!(code, 200);
                let reply = EchoReply::parse(&reply).expect("an echo reply");
                assert_eq!(reply.bytes, body.len() as u64);
                assert!(reply.recv_ns >= reply.start_ns);
                reply
            })
            .collect()
    }

    #[test]
    fn the_python_echo_serves_on_fd_3_and_on_port() {
        if !python3_present() {
            eprintln!("python3 not found: skipped");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let script = write_python_echo(dir.path()).unwrap();
        let script = script.to_str().unwrap();
        for fd3 in [true, false] {
            let (mut child, port) = launch(&["python3", script], fd3);
            two_posts(port);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    #[test]
    fn the_compiled_echo_serves_on_fd_3_and_on_port() {
        // The binary of this crate, built beside the test executable.
        let bin = std::env::current_exe()
            .unwrap()
            .parent()
            .and_then(|d| d.parent())
            .map(|d| d.join("sluice-bench"))
            .filter(|b| b.is_file());
        let (Some(bin), true) = (bin, python3_present()) else {
            eprintln!("sluice-bench binary or python3 not found: skipped");
            return;
        };
        for fd3 in [true, false] {
            let (mut child, port) = launch(&[bin.to_str().unwrap(), "fn-echo"], fd3);
            let replies = two_posts(port);
            assert_eq!(replies[0].start_ns, replies[1].start_ns);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
