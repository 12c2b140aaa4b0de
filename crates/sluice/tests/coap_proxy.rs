//! The CoAP proxy (`sluice::proxy::ShardProxies`) against real upstreams: libcoap's
//! `coap-server-notls` over `coap+tcp://` and `coap-server-openssl` over `coaps+tcp://` with a
//! test PKI, and small in-test RFC 8323 servers for what libcoap cannot be made to do on cue
//! (dropping a connection under a request, Release, silence).
//!
//! Each test runs the proxy the way a shard does: one current-thread runtime, a `LocalSet`.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use sluice::config::{parse_unchecked_files, Config};
use sluice::proxy::{ProxyMetrics, ShardProxies};
use sluice_proto::coap::tcp;
use sluice_proto::coap::{decode_tcp, encode_tcp, opt, Code, Message, MsgType, Token};
use sluice_testkit::{free_port, wait_for_port, TestPki};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::LocalSet;

/// A libcoap server process, killed on drop.
struct CoapServer {
    child: Child,
}

impl CoapServer {
    /// `coap-server-notls -d 10` (PUT creates resources) on 127.0.0.1:`port`, UDP and TCP.
    async fn notls(port: u16) -> CoapServer {
        CoapServer::start("coap-server-notls", &[], port, port).await
    }

    async fn start(binary: &str, extra: &[&str], port: u16, wait_on: u16) -> CoapServer {
        let port_s = port.to_string();
        let mut args = vec!["-A", "127.0.0.1", "-p", &port_s, "-d", "10"];
        args.extend_from_slice(extra);
        let child = Command::new(binary)
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {binary}: {e}"));
        let addr = format!("127.0.0.1:{wait_on}").parse().unwrap();
        wait_for_port(addr, Duration::from_secs(5)).await.unwrap();
        CoapServer { child }
    }
}

impl CoapServer {
    fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

impl Drop for CoapServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(proxies: &str) -> Config {
    parse_unchecked_files(proxies).unwrap_or_else(|e| panic!("{e}: {proxies}"))
}

fn proxies(cfg: &Config) -> (ShardProxies, Arc<ProxyMetrics>) {
    let metrics = Arc::new(ProxyMetrics::new(cfg));
    (ShardProxies::new(cfg, metrics.clone(), None), metrics)
}

fn request(code: Code, path: &[&str], payload: &[u8]) -> Message {
    let mut m = Message::new(
        MsgType::Con,
        code,
        0x4242,
        Token::from_slice(b"dev").unwrap(),
    );
    for p in path {
        m.add_option(opt::URI_PATH, Bytes::copy_from_slice(p.as_bytes()));
    }
    m.payload = Bytes::copy_from_slice(payload);
    m
}

/// Route and forward as the edge does; panics when the proxy does not claim the request.
async fn call(p: &ShardProxies, req: Message) -> Message {
    let route = p
        .route(&req)
        .expect("claimed by the proxy")
        .expect("routable");
    p.forward(route, req).await
}

async fn run_local<F: std::future::Future<Output = ()>>(f: F) {
    LocalSet::new().run_until(f).await
}

#[tokio::test(flavor = "current_thread")]
async fn get_put_post_delete_through_coap_tcp_get_the_servers_codes() {
    let port = free_port().unwrap();
    let _server = CoapServer::notls(port).await;
    let cfg = config(&format!(
        "[[coap.proxy]]\nname = \"cloud\"\nurl = \"coap+tcp://127.0.0.1:{port}\"\nprefix = \"cloud\"\n"
    ));
    let (p, metrics) = proxies(&cfg);
    run_local(async {
        let steps: [(Code, &[u8], Code, &[u8]); 6] = [
            (Code::PUT, b"hello", Code::CREATED, b""),
            (Code::GET, b"", Code::CONTENT, b"hello"),
            (Code::POST, b"again", Code::CHANGED, b""),
            (Code::DELETE, b"", Code::DELETED, b""),
            (Code::GET, b"", Code::NOT_FOUND, b"Not Found"),
            (Code::PUT, b"x", Code::CREATED, b""),
        ];
        for (method, body, code, payload) in steps {
            let res = call(&p, request(method, &["cloud", "dyn"], body)).await;
            assert_eq!(res.code, code, "{method:?}: {res:?}");
            assert_eq!(&res.payload[..], payload, "{method:?}");
            assert_eq!(
                res.token,
                Token::from_slice(b"dev").unwrap(),
                "device token restored"
            );
        }
        // A built-in resource: POST is not allowed there.
        let res = call(&p, request(Code::POST, &["cloud", "example_data"], b"x")).await;
        assert_eq!(res.code, Code::METHOD_NOT_ALLOWED);
        let res = call(&p, request(Code::GET, &["cloud", "example_data"], b"")).await;
        assert_eq!(res.code, Code::CONTENT);
        assert!(res.payload.starts_with(b"a123456789"), "{:?}", res.payload);
    })
    .await;
    let m = &metrics.upstreams[0].1;
    assert_eq!(m.connects.get(), 1, "every request used the one connection");
    assert_eq!(m.responses[2].get(), 6);
    assert_eq!(m.responses[4].get(), 2);
    assert_eq!(m.latency.count(), 8);
    assert_eq!(m.state_name(), "connected");
}

/// Issue 30: libcoap 4.3's server dropped the connection when ~250 requests with 1- and
/// 2-byte tokens were outstanding at once (the proxy's tokens were then the shortest encoding
/// of a counter); every request must be answered by the server.
#[tokio::test(flavor = "current_thread")]
async fn two_hundred_fifty_concurrent_small_puts_through_libcoap_are_all_answered() {
    let port = free_port().unwrap();
    let _server = CoapServer::notls(port).await;
    let cfg = config(&format!(
        "[[coap.proxy]]\nname = \"cloud\"\nurl = \"coap+tcp://127.0.0.1:{port}\"\nprefix = \"cloud\"\nrequest_timeout = \"10s\"\n"
    ));
    let (p, metrics) = proxies(&cfg);
    let p = std::rc::Rc::new(p);
    run_local(async {
        let next = std::rc::Rc::new(std::cell::Cell::new(0usize));
        let mut workers = Vec::new();
        for _ in 0..250 {
            let (p, next) = (p.clone(), next.clone());
            workers.push(tokio::task::spawn_local(async move {
                let mut codes = Vec::new();
                while next.get() < 2000 {
                    next.set(next.get() + 1);
                    codes.push(
                        call(
                            &p,
                            request(Code::PUT, &["cloud", "example_data"], &[b'x'; 16]),
                        )
                        .await
                        .code,
                    );
                }
                codes
            }));
        }
        let mut codes = Vec::new();
        for w in workers {
            codes.extend(w.await.unwrap());
        }
        let bad: Vec<_> = codes.iter().filter(|c| c.class() != 2).collect();
        assert!(
            bad.is_empty(),
            "{} of {} not 2.xx (first {:?}); reconnects: {}",
            bad.len(),
            codes.len(),
            bad.first(),
            metrics.upstreams[0].1.connects.get()
        );
    })
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn forward_proxying_by_proxy_uri_reaches_only_configured_upstreams() {
    let port = free_port().unwrap();
    let _server = CoapServer::notls(port).await;
    let cfg = config(&format!(
        "[[coap.proxy]]\nname = \"fwd\"\nurl = \"coap+tcp://127.0.0.1:{port}\"\nforward = true\n"
    ));
    let (p, _) = proxies(&cfg);
    run_local(async {
        let mut req = request(Code::PUT, &[], b"via proxy-uri");
        let uri = format!("coap+tcp://127.0.0.1:{port}/fwd%20res");
        req.add_option(opt::PROXY_URI, Bytes::from(uri.clone()));
        assert_eq!(call(&p, req).await.code, Code::CREATED);
        let mut req = request(Code::GET, &[], b"");
        req.add_option(opt::PROXY_URI, Bytes::from(uri));
        let res = call(&p, req).await;
        assert_eq!(
            (res.code, &res.payload[..]),
            (Code::CONTENT, &b"via proxy-uri"[..])
        );
        // Proxy-Scheme + Uri-Host + Uri-Port + Uri-Path
        let mut req = request(Code::GET, &["fwd res"], b"");
        req.add_option(opt::URI_HOST, &b"127.0.0.1"[..]);
        req.add_uint_option(opt::URI_PORT, port as u32);
        req.add_option(opt::PROXY_SCHEME, &b"coap+tcp"[..]);
        assert_eq!(call(&p, req).await.code, Code::CONTENT);
        // Anything else: 5.05, never a connection elsewhere.
        let mut req = request(Code::GET, &[], b"");
        req.add_option(opt::PROXY_URI, &b"coap+tcp://192.0.2.1/x"[..]);
        assert_eq!(
            p.route(&req).unwrap().unwrap_err(),
            Code::PROXYING_NOT_SUPPORTED
        );
        // Not for the proxy at all.
        assert!(p.route(&request(Code::GET, &["ps", "t"], b"")).is_none());
    })
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn coaps_tcp_with_a_test_pki() {
    let pki = TestPki::generate();
    let port = free_port().unwrap();
    let cert = pki.server_cert_path().to_str().unwrap().to_string();
    let key = pki.server_key_path().to_str().unwrap().to_string();
    let _server = CoapServer::start(
        "coap-server-openssl",
        &["-c", &cert, "-j", &key, "-n"],
        port,
        port + 1,
    )
    .await;
    let cfg = config(&format!(
        "[[coap.proxy]]\nname = \"tls\"\nurl = \"coaps+tcp://127.0.0.1:{}\"\nprefix = \"secure\"\nca_file = \"{}\"\n",
        port + 1,
        pki.ca_path().display()
    ));
    let (p, metrics) = proxies(&cfg);
    run_local(async {
        let res = call(&p, request(Code::PUT, &["secure", "t"], b"over tls")).await;
        assert_eq!(res.code, Code::CREATED, "{res:?}");
        let res = call(&p, request(Code::GET, &["secure", "t"], b"")).await;
        assert_eq!(
            (res.code, &res.payload[..]),
            (Code::CONTENT, &b"over tls"[..])
        );
        let res = call(&p, request(Code::DELETE, &["secure", "t"], b"")).await;
        assert_eq!(res.code, Code::DELETED);
    })
    .await;
    assert_eq!(metrics.upstreams[0].1.connects.get(), 1);
}

#[tokio::test(flavor = "current_thread")]
async fn beyond_outstanding_and_waiting_requests_get_5_03_with_max_age() {
    let port = free_port().unwrap();
    let _server = CoapServer::notls(port).await;
    let cfg = config(&format!(
        "[coap]\nretry_after = \"3s\"\n[[coap.proxy]]\nname = \"c\"\nurl = \"coap+tcp://127.0.0.1:{port}\"\nprefix = \"c\"\nmax_outstanding = 4\nmax_waiting = 8\n"
    ));
    let (p, metrics) = proxies(&cfg);
    run_local(async {
        let futures: Vec<_> = (0..20)
            .map(|_| {
                let req = request(Code::GET, &["c", "example_data"], b"");
                let route = p.route(&req).unwrap().unwrap();
                tokio::task::spawn_local(p.forward(route, req))
            })
            .collect();
        let mut content = 0;
        let mut busy = 0;
        for f in futures {
            let res = f.await.unwrap();
            match res.code {
                Code::CONTENT => content += 1,
                Code::SERVICE_UNAVAILABLE => {
                    assert_eq!(res.uint_option(opt::MAX_AGE), Some(3));
                    busy += 1;
                }
                other => panic!("unexpected {other}"),
            }
        }
        assert_eq!(
            (content, busy),
            (12, 8),
            "4 outstanding + 8 waiting, the rest 5.03"
        );
    })
    .await;
    assert_eq!(metrics.upstreams[0].1.unavailable.get(), 8);
}

/// An RFC 8323 server in the test: accepts, exchanges CSMs, then runs `script` on each
/// connection (connection number, stream, buffered bytes).
async fn fake_upstream<F, Fut>(script: F) -> u16
where
    F: Fn(usize, TcpStream, BytesMut) -> Fut + 'static,
    Fut: std::future::Future<Output = ()> + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::task::spawn_local(async move {
        let mut n = 0;
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = BytesMut::new();
            let csm = read_msg(&mut s, &mut buf).await.expect("client CSM");
            assert_eq!(csm.code, Code::CSM, "the client's first message is its CSM");
            write_msg(&mut s, &tcp::csm(1152, false)).await;
            tokio::task::spawn_local(script(n, s, buf));
            n += 1;
        }
    });
    port
}

async fn read_msg(s: &mut TcpStream, buf: &mut BytesMut) -> Option<Message> {
    loop {
        if let Some(m) = decode_tcp(buf, 1 << 20).unwrap() {
            return Some(m);
        }
        if s.read_buf(buf).await.ok()? == 0 {
            return None;
        }
    }
}

async fn write_msg(s: &mut TcpStream, m: &Message) {
    let mut out = BytesMut::new();
    encode_tcp(m, &mut out);
    s.write_all(&out).await.unwrap();
}

fn answer(req: &Message, code: Code, payload: &'static [u8]) -> Message {
    let mut res = Message::new(MsgType::Con, code, 0, req.token);
    res.payload = Bytes::from_static(payload);
    res
}

#[tokio::test(flavor = "current_thread")]
async fn a_connection_lost_under_requests_retries_idempotent_ones_once_and_answers_post_5_02() {
    run_local(async {
        // Connection 0 reads two requests and drops; later connections answer everything.
        let port = fake_upstream(|n, mut s, mut buf| async move {
            if n == 0 {
                let _ = read_msg(&mut s, &mut buf).await;
                let _ = read_msg(&mut s, &mut buf).await;
                return;
            }
            while let Some(req) = read_msg(&mut s, &mut buf).await {
                write_msg(&mut s, &answer(&req, Code::CONTENT, b"second")).await;
            }
        })
        .await;
        let cfg = config(&format!(
            "[[coap.proxy]]\nname = \"f\"\nurl = \"coap+tcp://127.0.0.1:{port}\"\nprefix = \"f\"\n"
        ));
        let (p, metrics) = proxies(&cfg);
        let send = |code| {
            let req = request(code, &["f", "r"], b"");
            let route = p.route(&req).unwrap().unwrap();
            tokio::task::spawn_local(p.forward(route, req))
        };
        let get = send(Code::GET);
        let post = send(Code::POST);
        let get = get.await.unwrap();
        let post = post.await.unwrap();
        assert_eq!(
            (get.code, &get.payload[..]),
            (Code::CONTENT, &b"second"[..])
        );
        assert_eq!(post.code, Code::BAD_GATEWAY);
        let m = &metrics.upstreams[0].1;
        assert_eq!((m.retries.get(), m.bad_gateway.get()), (1, 1));
        assert_eq!(m.connects.get(), 2);
    })
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn pings_are_ponged_release_reconnects_and_silence_is_5_04() {
    run_local(async {
        let (pong_tx, pong_rx) = tokio::sync::oneshot::channel::<Message>();
        let pong_tx = std::cell::RefCell::new(Some(pong_tx));
        let port = fake_upstream(move |n, mut s, mut buf| {
            let pong_tx = pong_tx.borrow_mut().take();
            async move {
                match n {
                    0 => {
                        // Ping with a token: the Pong echoes it. Then Release.
                        write_msg(&mut s, &tcp::ping(Token::from_slice(&[0x5a]).unwrap())).await;
                        let pong = read_msg(&mut s, &mut buf).await.unwrap();
                        if let Some(tx) = pong_tx {
                            let _ = tx.send(pong);
                        }
                        let req = read_msg(&mut s, &mut buf).await.unwrap();
                        write_msg(&mut s, &answer(&req, Code::CONTENT, b"first")).await;
                        write_msg(&mut s, &tcp::release()).await;
                        let _ = read_msg(&mut s, &mut buf).await;
                    }
                    _ => {
                        // Reads requests, answers none, answers Pings.
                        while let Some(m) = read_msg(&mut s, &mut buf).await {
                            if m.code == Code::PING {
                                write_msg(&mut s, &tcp::pong(&m)).await;
                            }
                        }
                    }
                }
            }
        })
        .await;
        let cfg = config(&format!(
            "[[coap.proxy]]\nname = \"f\"\nurl = \"coap+tcp://127.0.0.1:{port}\"\nprefix = \"f\"\nrequest_timeout = \"300ms\"\nmax_outstanding = 1\n"
        ));
        let (p, metrics) = proxies(&cfg);
        let res = call(&p, request(Code::GET, &["f", "a"], b"")).await;
        assert_eq!((res.code, &res.payload[..]), (Code::CONTENT, &b"first"[..]));
        let pong = pong_rx.await.unwrap();
        assert_eq!((pong.code, pong.token.as_slice()), (Code::PONG, &[0x5a][..]));
        // After Release the proxy reconnects; this server never answers: 5.04, and the one
        // outstanding slot is freed for the next request (which also times out, not 5.03).
        let res = call(&p, request(Code::GET, &["f", "b"], b"")).await;
        assert_eq!(res.code, Code::GATEWAY_TIMEOUT);
        let res = call(&p, request(Code::GET, &["f", "c"], b"")).await;
        assert_eq!(res.code, Code::GATEWAY_TIMEOUT);
        let m = &metrics.upstreams[0].1;
        assert_eq!(m.connects.get(), 2);
        assert_eq!(m.timeouts.get(), 2);
        assert_eq!(m.outstanding.get(), 0);
    })
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn an_upstream_without_pongs_is_reconnected() {
    run_local(async {
        let port = fake_upstream(|n, mut s, mut buf| async move {
            while let Some(m) = read_msg(&mut s, &mut buf).await {
                if m.code.is_request() && n > 0 {
                    write_msg(&mut s, &answer(&m, Code::CONTENT, b"ok")).await;
                }
                if m.code.is_request() && n == 0 {
                    write_msg(&mut s, &answer(&m, Code::CONTENT, b"ok")).await;
                }
                // Pings are never answered.
            }
        })
        .await;
        let cfg = config(&format!(
            "[[coap.proxy]]\nname = \"f\"\nurl = \"coap+tcp://127.0.0.1:{port}\"\nprefix = \"f\"\nping_interval = \"100ms\"\n"
        ));
        let (p, metrics) = proxies(&cfg);
        assert_eq!(call(&p, request(Code::GET, &["f"], b"")).await.code, Code::CONTENT);
        // Idle: Ping after 100 ms, no Pong within another 100 ms: the connection is dropped.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let m = &metrics.upstreams[0].1;
        assert!(m.disconnects.get() >= 1, "no Pong must end the connection");
        assert_eq!(call(&p, request(Code::GET, &["f"], b"")).await.code, Code::CONTENT);
        assert!(m.connects.get() >= 2);
    })
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn the_upstream_killed_and_restarted_mid_stream_loses_no_request() {
    let port = free_port().unwrap();
    let server = CoapServer::notls(port).await;
    let cfg = config(&format!(
        "[[coap.proxy]]\nname = \"c\"\nurl = \"coap+tcp://127.0.0.1:{port}\"\nprefix = \"c\"\n"
    ));
    let (p, metrics) = proxies(&cfg);
    run_local(async {
        let mut server = Some(server);
        let mut restarted = None;
        let mut answered = Vec::new();
        for round in 0..40 {
            if round == 15 {
                // Freeze the server so this round's requests are surely unanswered in flight.
                server.as_ref().unwrap().signal("STOP");
            }
            let batch: Vec<_> = [Code::GET, Code::PUT, Code::POST]
                .into_iter()
                .map(|code| {
                    let req = request(code, &["c", "example_data"], b"v");
                    let route = p.route(&req).unwrap().unwrap();
                    (code, tokio::task::spawn_local(p.forward(route, req)))
                })
                .collect();
            if round == 15 {
                // Let the batch be written, then kill the server under it; it comes back on
                // the same port 300 ms later while the proxy reconnects with backoff.
                tokio::time::sleep(Duration::from_millis(50)).await;
                drop(server.take());
                restarted = Some(tokio::task::spawn_local(async move {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    CoapServer::notls(port).await
                }));
            }
            for (code, f) in batch {
                answered.push((round, code, f.await.unwrap().code));
            }
        }
        let _server = restarted.unwrap().await.unwrap();
        assert_eq!(answered.len(), 120, "every request is answered");
        for (round, code, res) in &answered {
            match *code {
                // Idempotent: the server's own answer, retried on the new connection if need be.
                Code::GET => assert_eq!(*res, Code::CONTENT, "round {round}"),
                Code::PUT => assert_eq!(*res, Code::CHANGED, "round {round}"),
                // POST: the server's 4.05, or 5.02 when the connection died under it.
                _ => assert!(
                    *res == Code::METHOD_NOT_ALLOWED || *res == Code::BAD_GATEWAY,
                    "round {round}: {res}"
                ),
            }
        }
    })
    .await;
    let m = &metrics.upstreams[0].1;
    assert!(m.connects.get() >= 2, "reconnected after the restart");
    assert_eq!(m.timeouts.get(), 0);
    // Round 15's GET and PUT were retried on the new connection, its POST answered 5.02.
    assert_eq!((m.retries.get(), m.bad_gateway.get()), (2, 1));
}

#[tokio::test(flavor = "current_thread")]
async fn a_request_over_the_servers_max_message_size_is_4_13_with_size1() {
    run_local(async {
        // The fake server's CSM says 1152 bytes.
        let port = fake_upstream(|_, mut s, mut buf| async move {
            while let Some(req) = read_msg(&mut s, &mut buf).await {
                write_msg(&mut s, &answer(&req, Code::CHANGED, b"")).await;
            }
        })
        .await;
        let cfg = config(&format!(
            "[[coap.proxy]]\nname = \"f\"\nurl = \"coap+tcp://127.0.0.1:{port}\"\nprefix = \"f\"\n"
        ));
        let (p, _) = proxies(&cfg);
        let res = call(&p, request(Code::PUT, &["f", "r"], &[7u8; 2000])).await;
        assert_eq!(res.code, Code::REQUEST_ENTITY_TOO_LARGE);
        assert_eq!(res.uint_option(opt::SIZE1), Some(1152));
        let res = call(&p, request(Code::PUT, &["f", "r"], &[7u8; 1000])).await;
        assert_eq!(res.code, Code::CHANGED, "the connection is still good");
    })
    .await;
}

/// A running gateway shows every shard's upstream in /api/v1/status and /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_reports_each_shards_upstream_connection() {
    let text = "[gateway]\npin_threads = false\nshards = 2\n[mqtt]\nlisten = \"127.0.0.1:0\"\n\
        [admin]\nlisten = \"127.0.0.1:0\"\n[coap]\nlisten = \"127.0.0.1:0\"\n\
        [[coap.proxy]]\nname = \"cloud\"\nurl = \"coap+tcp://127.0.0.1:9\"\nprefix = \"cloud\"\n";
    let config = sluice::config::parse(text).unwrap();
    let gw = sluice::app::Gateway::build(config)
        .unwrap()
        .start()
        .unwrap();
    let status = gw.status_json();
    let ups = status["coap_proxy"].as_array().unwrap().clone();
    assert_eq!(ups.len(), 2, "{status}");
    for (i, u) in ups.iter().enumerate() {
        assert_eq!(u["shard"], i);
        assert_eq!(u["upstream"], "cloud");
        assert_eq!(
            u["state"], "disconnected",
            "nothing connects before a request"
        );
    }
    let metrics = gw.metrics_text();
    assert!(
        metrics.contains(
            "sluice_coap_proxy_state{shard=\"1\",upstream=\"cloud\",state=\"disconnected\"} 1"
        ),
        "{metrics}"
    );
    gw.shutdown();
}

/// `coap-client-notls` with `-v 6`: the response code of the last message it printed.
fn coap_client(args: &[&str]) -> (String, String) {
    let out = Command::new("coap-client-notls")
        .args(["-v", "6", "-B", "10"])
        .args(args)
        .output()
        .expect("run coap-client-notls");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The last response code printed (requests are 0.xx; "c:2.05" etc. are responses).
    let code = text
        .lines()
        .filter(|l| l.starts_with("v:1 "))
        .filter_map(|l| l.split(" c:").nth(1)?.split(' ').next())
        .rfind(|c| c.starts_with(['2', '4', '5']))
        .unwrap_or_default()
        .to_string();
    (code, text)
}

/// A CoAP device (libcoap's client over UDP) → sluice's CoAP edge → the proxy → libcoap's
/// server over coap+tcp, and the server's answers back, for every method.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coap_client_through_sluice_to_a_coap_tcp_server() {
    let port = free_port().unwrap();
    let _server = CoapServer::notls(port).await;
    let text = format!(
        "[gateway]\npin_threads = false\nshards = 2\n[mqtt]\nlisten = \"127.0.0.1:0\"\n\
        [coap]\nlisten = \"127.0.0.1:0\"\n\
        [[coap.proxy]]\nname = \"cloud\"\nurl = \"coap+tcp://127.0.0.1:{port}\"\nprefix = \"cloud\"\nforward = true\n"
    );
    let gw = sluice::app::Gateway::build(sluice::config::parse(&text).unwrap())
        .unwrap()
        .start()
        .unwrap();
    let gw_addr = gw.coap_addr().expect("CoAP listener");
    let base = format!("coap://{gw_addr}/cloud");
    let run = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            coap_client(&args)
        })
    };
    let steps: [(&str, Option<&str>, &str, &str); 6] = [
        ("put", Some("from device"), "/e2e", "2.01"),
        ("get", None, "/e2e", "2.05"),
        ("post", Some("more"), "/e2e", "2.04"),
        ("delete", None, "/e2e", "2.02"),
        ("get", None, "/e2e", "4.04"),
        ("post", Some("x"), "/example_data", "4.05"),
    ];
    for (method, body, path, want) in steps {
        let mut args = vec!["-m".to_string(), method.to_string()];
        if let Some(b) = body {
            args.extend(["-e".to_string(), b.to_string()]);
        }
        args.push(format!("{base}{path}"));
        let (code, text) = run(args).await.unwrap();
        assert_eq!(code, want, "{method} {path}:\n{text}");
        if method == "get" && want == "2.05" {
            assert!(text.contains("from device"), "{text}");
        }
    }
    // Forward proxying: coap-client's -P sends Proxy-Uri to sluice.
    let (code, text) = run(vec![
        "-m".into(),
        "get".into(),
        "-P".into(),
        format!("coap://{gw_addr}"),
        format!("coap+tcp://127.0.0.1:{port}/example_data"),
    ])
    .await
    .unwrap();
    assert_eq!(code, "2.05", "{text}");
    // The resource is larger than a datagram: it came block by block (Block2 asked of the
    // upstream by the proxy, then by the client), and whole.
    assert!(text.matches("c:2.05").count() >= 2, "{text}");
    assert!(
        text.contains("s123456789t123456789\n") || text.ends_with("t123456789"),
        "{text}"
    );
    let status = gw.status_json();
    let connected = status["coap_proxy"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|u| u["state"] == "connected")
        .count();
    assert!(connected >= 1, "{status}");
    gw.shutdown();
}
