use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct FakeSource;

impl AdminSource for FakeSource {
    fn render_metrics(&self, w: &mut PromWriter) {
        w.counter(
            "sluice_test_messages_total",
            "Messages seen.",
            &[("shard", "0")],
            42,
        );
    }
    fn status(&self) -> serde_json::Value {
        serde_json::json!({ "shards": 2, "uplinks": [{ "name": "cloud", "connected": true }] })
    }
    fn devices(&self, after: Option<&str>, limit: usize) -> Option<serde_json::Value> {
        Some(serde_json::json!({ "after": after, "limit": limit }))
    }
}

struct Server {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<io::Result<()>>,
}

async fn start(limits: Limits) -> Server {
    start_with(Access::default(), limits).await
}

async fn start_with(access: Access, limits: Limits) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, shutdown) = watch::channel(false);
    let task = tokio::spawn(serve_with(
        listener,
        Arc::new(FakeSource),
        access,
        shutdown,
        limits,
    ));
    Server { addr, stop, task }
}

const TOKEN: &str = "0123456789abcdef-token";

async fn start_with_token() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("token");
    std::fs::write(&path, format!("{TOKEN}\n")).unwrap();
    let admin = crate::config::AdminConfig {
        token_file: Some(path),
        ..Default::default()
    };
    let access = Access {
        token: admin.read_token().unwrap(),
        tls: None,
    };
    start_with(
        access,
        Limits {
            max_connections: MAX_CONNECTIONS,
            header_read_timeout: HEADER_READ_TIMEOUT,
        },
    )
    .await
}

async fn start_default() -> Server {
    start(Limits {
        max_connections: MAX_CONNECTIONS,
        header_read_timeout: HEADER_READ_TIMEOUT,
    })
    .await
}

/// Status line, lower-cased headers, and body of one `Connection: close` exchange.
struct Reply {
    status_line: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

async fn exchange(stream: &mut TcpStream, method: &str, path: &str) -> Reply {
    exchange_with(stream, method, path, "").await
}

async fn exchange_with(stream: &mut TcpStream, method: &str, path: &str, headers: &str) -> Reply {
    let request =
        format!("{method} {path} HTTP/1.1\r\nHost: test\r\n{headers}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .expect("reply within 10s")
        .unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("a complete head");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap().to_string();
    let headers = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.trim().to_ascii_lowercase(), v.trim().to_string())
        })
        .collect();
    Reply {
        status_line,
        headers,
        body: body.to_string(),
    }
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    exchange(&mut stream, "GET", path).await
}

#[tokio::test]
async fn metrics_endpoint_serves_the_sources_metrics_as_prometheus_text() {
    let server = start_default().await;
    let reply = get(server.addr, "/metrics").await;
    assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
    assert!(reply
        .header("content-type")
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    assert!(
        reply
            .body
            .contains("# TYPE sluice_test_messages_total counter\n"),
        "{}",
        reply.body
    );
    assert!(
        reply
            .body
            .contains("sluice_test_messages_total{shard=\"0\"} 42\n"),
        "{}",
        reply.body
    );
}

#[tokio::test]
async fn status_endpoint_serves_the_sources_json() {
    let server = start_default().await;
    let reply = get(server.addr, "/api/v1/status?verbose=1").await;
    assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let doc: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(doc, FakeSource.status());
}

#[tokio::test]
async fn devices_endpoint_decodes_after_and_bounds_limit() {
    let server = start_default().await;
    let reply = get(server.addr, "/api/v1/devices").await;
    assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
    let doc: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(
        doc,
        serde_json::json!({ "after": null, "limit": DEVICES_PAGE })
    );
    let reply = get(server.addr, "/api/v1/devices?after=a%20b%2F%C3%BC&limit=7").await;
    let doc: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(doc, serde_json::json!({ "after": "a b/ü", "limit": 7 }));
    for bad in [
        "limit=0",
        "limit=100001",
        "limit=x",
        "after=%zz",
        "after=%ff",
    ] {
        let reply = get(server.addr, &format!("/api/v1/devices?{bad}")).await;
        assert_eq!(reply.status_line, "HTTP/1.1 400 Bad Request", "{bad}");
    }
}

#[tokio::test]
async fn index_lists_the_endpoints() {
    let server = start_default().await;
    let reply = get(server.addr, "/").await;
    assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
    assert!(
        reply.body.contains("/metrics") && reply.body.contains("/api/v1/status"),
        "{}",
        reply.body
    );
}

#[tokio::test]
async fn unknown_paths_get_404_with_a_one_line_body() {
    let server = start_default().await;
    for path in ["/nope", "/metrics/", "/api/v1"] {
        let reply = get(server.addr, path).await;
        assert_eq!(reply.status_line, "HTTP/1.1 404 Not Found", "{path}");
        assert_eq!(reply.body.lines().count(), 1, "{path}: {}", reply.body);
    }
}

#[tokio::test]
async fn without_a_token_writing_methods_get_403_saying_to_configure_one() {
    let server = start_default().await;
    for method in ["POST", "PUT", "DELETE"] {
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let reply = exchange(&mut stream, method, "/metrics").await;
        assert_eq!(reply.status_line, "HTTP/1.1 403 Forbidden", "{method}");
        assert!(reply.body.contains("admin.token_file"), "{}", reply.body);
    }
    let m = get(server.addr, "/metrics").await.body;
    assert!(
        m.contains("sluice_admin_refused_total{reason=\"writes_need_token\"} 3\n"),
        "{m}"
    );
}

#[tokio::test]
async fn the_reload_route_is_a_writing_one_and_only_takes_post() {
    // No token configured: refused before the source is asked, even on loopback.
    let server = start_default().await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    let reply = exchange(&mut stream, "POST", "/api/v1/reload").await;
    assert_eq!(reply.status_line, "HTTP/1.1 403 Forbidden");
    // With the token: GET is answered 405 naming POST; a source that does not reload
    // answers POST with 404.
    let server = start_with_token().await;
    let bearer = format!("Authorization: Bearer {TOKEN}\r\n");
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    let reply = exchange_with(&mut stream, "GET", "/api/v1/reload", &bearer).await;
    assert_eq!(reply.status_line, "HTTP/1.1 405 Method Not Allowed");
    assert_eq!(reply.header("allow"), Some("POST"));
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    let reply = exchange_with(&mut stream, "POST", "/api/v1/reload", &bearer).await;
    assert_eq!(reply.status_line, "HTTP/1.1 404 Not Found");
}

#[tokio::test]
async fn with_a_token_every_request_needs_it_and_writing_methods_then_get_405() {
    let server = start_with_token().await;
    let bearer = format!("Authorization: Bearer {TOKEN}\r\n");
    for (headers, want) in [
        (String::new(), "HTTP/1.1 401 Unauthorized"),
        (
            "Authorization: Bearer 0123456789abcdef-tokeN\r\n".to_string(),
            "HTTP/1.1 401 Unauthorized",
        ),
        (
            format!("Authorization: Bearer {TOKEN}x\r\n"),
            "HTTP/1.1 401 Unauthorized",
        ),
        (
            format!("Authorization: Basic {TOKEN}\r\n"),
            "HTTP/1.1 401 Unauthorized",
        ),
        (bearer.clone(), "HTTP/1.1 200 OK"),
        (
            format!("Authorization: bearer {TOKEN}\r\n"),
            "HTTP/1.1 200 OK",
        ),
    ] {
        for path in ["/metrics", "/api/v1/status", "/api/v1/overview"] {
            let mut stream = TcpStream::connect(server.addr).await.unwrap();
            let reply = exchange_with(&mut stream, "GET", path, &headers).await;
            assert_eq!(reply.status_line, want, "{path} with {headers:?}");
            if want.contains("401") {
                assert_eq!(
                    reply.header("www-authenticate"),
                    Some("Bearer realm=\"sluice admin\"")
                );
                assert!(!reply.body.contains(TOKEN), "{}", reply.body);
            }
        }
    }
    for method in ["POST", "PUT", "DELETE"] {
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let reply = exchange(&mut stream, method, "/metrics").await;
        assert_eq!(reply.status_line, "HTTP/1.1 401 Unauthorized", "{method}");
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let reply = exchange_with(&mut stream, method, "/metrics", &bearer).await;
        assert_eq!(
            reply.status_line, "HTTP/1.1 405 Method Not Allowed",
            "{method}"
        );
        assert_eq!(reply.header("allow"), Some("GET"));
    }
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    let m = exchange_with(&mut stream, "GET", "/metrics", &bearer)
        .await
        .body;
    // 4 refused headers × 3 paths + 3 writing methods without the token.
    assert!(
        m.contains("sluice_admin_refused_total{reason=\"unauthorized\"} 15\n"),
        "{m}"
    );
}

#[tokio::test]
async fn with_a_token_the_dashboard_assets_load_but_its_data_needs_the_token() {
    let server = start_with_token().await;
    for path in ["/", "/app.js", "/style.css"] {
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let reply = exchange_with(&mut stream, "GET", path, "Accept: text/html,*/*\r\n").await;
        assert_eq!(reply.status_line, "HTTP/1.1 200 OK", "{path}");
        assert!(reply
            .header("content-security-policy")
            .is_some_and(|c| c.contains("default-src 'none'")));
    }
    for path in ["/api/v1/events", "/api/v1/history", "/api/v1/overview"] {
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let reply = exchange(&mut stream, "GET", path).await;
        assert_eq!(reply.status_line, "HTTP/1.1 401 Unauthorized", "{path}");
    }
    // Writing to an asset path is not exempt.
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    let reply = exchange(&mut stream, "POST", "/").await;
    assert_eq!(reply.status_line, "HTTP/1.1 401 Unauthorized");
}

#[tokio::test]
async fn a_browser_gets_the_dashboard_at_the_root_and_curl_the_list() {
    let server = start_default().await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    let reply = exchange_with(&mut stream, "GET", "/", "Accept: text/html\r\n").await;
    assert_eq!(
        reply.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert!(
        reply.body.contains("<script src=\"app.js\">"),
        "{}",
        reply.body
    );
    let reply = get(server.addr, "/").await;
    assert!(reply.body.contains("/api/v1/events"), "{}", reply.body);
}

#[tokio::test]
async fn the_overview_is_there_from_the_first_request() {
    let server = start_default().await;
    let reply = get(server.addr, "/api/v1/overview").await;
    assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
    let doc: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert!(doc["seq"].as_u64() >= Some(1), "{doc}");
}

/// Reads from `stream` until `want` complete events (blank-line separated) arrived.
async fn read_events(stream: &mut TcpStream, want: usize) -> String {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&raw)
        .matches("event: overview")
        .count()
        < want
    {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("an event within 5 s")
            .unwrap();
        assert!(n > 0, "stream closed: {}", String::from_utf8_lossy(&raw));
        raw.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&raw).into_owned()
}

#[tokio::test]
async fn the_event_stream_sends_an_overview_each_tick_and_refuses_streams_beyond_its_bound() {
    let server = start_default().await;
    let mut streams = Vec::new();
    for _ in 0..events::MAX_STREAMS {
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        s.write_all(b"GET /api/v1/events HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        streams.push(s);
    }
    let text = read_events(&mut streams[0], 2).await;
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    assert!(text.contains("content-type: text/event-stream"), "{text}");
    assert!(text.contains("data: {"), "{text}");
    let mut extra = TcpStream::connect(server.addr).await.unwrap();
    let reply = exchange(&mut extra, "GET", "/api/v1/events").await;
    assert_eq!(reply.status_line, "HTTP/1.1 503 Service Unavailable");
    assert_eq!(reply.header("retry-after"), Some("5"));
    drop(streams.pop());
    // The closed stream's place is free again once the server noticed (next tick).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        s.write_all(b"GET /api/v1/events HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut head = [0u8; 12];
        s.read_exact(&mut head).await.unwrap();
        if &head == b"HTTP/1.1 200" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the freed stream slot was not reused"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let m = get(server.addr, "/metrics").await.body;
    assert!(
        m.contains("sluice_admin_event_streams_refused_total "),
        "{m}"
    );
}

#[test]
fn bearer_values_match_only_the_exact_token() {
    let t = b"0123456789abcdef";
    assert!(bearer_matches(b"Bearer 0123456789abcdef", t));
    assert!(bearer_matches(b"BEARER 0123456789abcdef ", t));
    for v in [
        &b""[..],
        b"Bearer",
        b"Bearer ",
        b"Bearer 0123456789abcde",
        b"Bearer 0123456789abcdefg",
        b"Basic 0123456789abcdef",
        b"Bearer0123456789abcdef",
    ] {
        assert!(!bearer_matches(v, t), "{}", String::from_utf8_lossy(v));
    }
}

#[tokio::test]
async fn keep_alive_connection_serves_several_requests() {
    let server = start_default().await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = stream.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200 OK"));
    let reply = exchange(&mut stream, "GET", "/api/v1/status").await;
    assert_eq!(reply.status_line, "HTTP/1.1 200 OK");
}

#[tokio::test]
async fn client_that_never_finishes_its_headers_is_disconnected() {
    let server = start(Limits {
        max_connections: 4,
        header_read_timeout: Duration::from_millis(200),
    })
    .await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: te")
        .await
        .unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
    assert!(read.is_ok(), "the server kept a stalled connection open");
    assert!(!String::from_utf8_lossy(&rest).contains("200 OK"));
}

#[tokio::test]
async fn idle_connections_are_closed_after_the_header_timeout() {
    let server = start(Limits {
        max_connections: 4,
        header_read_timeout: Duration::from_millis(200),
    })
    .await;
    let mut silent = TcpStream::connect(server.addr).await.unwrap();
    let mut kept_alive = TcpStream::connect(server.addr).await.unwrap();
    kept_alive
        .write_all(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    for stream in [&mut silent, &mut kept_alive] {
        let mut rest = Vec::new();
        let read =
            tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
        assert!(read.is_ok(), "an idle connection stayed open");
    }
}

#[tokio::test]
async fn connections_beyond_the_cap_wait_for_a_free_slot() {
    let server = start(Limits {
        max_connections: 1,
        header_read_timeout: Duration::from_secs(30),
    })
    .await;
    let hog = TcpStream::connect(server.addr).await.unwrap();
    // Let the server accept the hog and take the only slot.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut waiting = TcpStream::connect(server.addr).await.unwrap();
    waiting
        .write_all(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let early = tokio::time::timeout(Duration::from_millis(300), waiting.read(&mut buf)).await;
    assert!(
        early.is_err(),
        "a second connection was served while the cap was reached"
    );
    drop(hog);
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), waiting.read_to_end(&mut raw))
        .await
        .unwrap()
        .unwrap();
    assert!(
        raw.starts_with(b"HTTP/1.1 200 OK"),
        "{}",
        String::from_utf8_lossy(&raw)
    );
}

#[tokio::test]
async fn shutdown_stops_accepting_and_closes_idle_connections() {
    let server = start_default().await;
    let mut idle = TcpStream::connect(server.addr).await.unwrap();
    assert_eq!(get(server.addr, "/").await.status_line, "HTTP/1.1 200 OK");
    server.stop.send(true).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(5), server.task).await;
    assert!(
        matches!(result, Ok(Ok(Ok(())))),
        "serve did not return Ok after shutdown"
    );
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(1), idle.read_to_end(&mut rest)).await;
    assert!(
        closed.is_ok(),
        "an idle connection stayed open after shutdown"
    );
    assert!(
        TcpStream::connect(server.addr).await.is_err(),
        "the listener still accepts"
    );
}
