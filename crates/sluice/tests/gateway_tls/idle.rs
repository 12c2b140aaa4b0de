//! What an idle device connection costs by transport (plain, TLS, WebSocket, secure
//! WebSocket), measured as the gateway's RSS growth.

use super::*;

/// Opens `n` MQTT connections (raw CONNECT, CONNACK read) from a python child, TLS when
/// `ca` is given or WebSocket when `ws`, and keeps them open until its stdin closes.
const PY_IDLE_CLIENTS: &str = r#"
import socket, ssl, sys, base64, os
host, port, n, ca, ws = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "ws"
ctx = None
if ca != "-":
    ctx = ssl.create_default_context(cafile=ca)
socks = []
prefix = os.urandom(4).hex()
for i in range(n):
    s = socket.create_connection((host, port))
    if ctx:
        s = ctx.wrap_socket(s, server_hostname="localhost")
    cid = ("idle-%s-%d" % (prefix, i)).encode()
    body = b"\x00\x04MQTT\x04\x02\x00\x00" + len(cid).to_bytes(2, "big") + cid
    pkt = bytes([0x10, len(body)]) + body
    if ws:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(("GET /mqtt HTTP/1.1\r\nHost: gw\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n" % key).encode())
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += s.recv(1)
        mask = b"\x01\x02\x03\x04"
        pkt = bytes([0x82, 0x80 | len(pkt)]) + mask + bytes(b ^ mask[j % 4] for j, b in enumerate(pkt))
    s.sendall(pkt)
    got = b""
    want = 6 if ws else 4
    while len(got) < want:
        got += s.recv(want - len(got))
    socks.append(s)
print("open", len(socks), flush=True)
sys.stdin.read()
"#;

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Opens `n` idle connections of one kind from a python child; returns the child (the
/// connections close when it is dropped) once the gateway has registered every device.
async fn open_idle(
    gw: &RunningGateway,
    addr: SocketAddr,
    n: usize,
    ca: Option<&Path>,
    ws: bool,
) -> tokio::process::Child {
    let before_devices = gw.status_json()["devices"].as_i64().unwrap_or(0);
    let mut child = tokio::process::Command::new("python3")
        .arg("-c")
        .arg(PY_IDLE_CLIENTS)
        .arg("127.0.0.1")
        .arg(addr.port().to_string())
        .arg(n.to_string())
        .arg(ca.map_or("-".to_string(), |p| p.display().to_string()))
        .arg(if ws { "ws" } else { "tcp" })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3");
    let mut out = child.stdout.take().expect("stdout");
    let mut line = Vec::new();
    let mut b = [0u8; 64];
    while !line.contains(&b'\n') {
        let k = tokio::time::timeout(Duration::from_secs(120), out.read(&mut b))
            .await
            .expect("clients open in time")
            .expect("read");
        assert!(k > 0, "client script ended early");
        line.extend_from_slice(&b[..k]);
    }
    common::wait_until("devices registered", Duration::from_secs(20), || {
        gw.status_json()["devices"].as_i64().unwrap_or(0) >= before_devices + n as i64
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    child
}

/// RSS growth per connection while `n` more idle connections of one kind are held (those
/// opened before stay open, so no freed memory is reused).
async fn idle_cost(
    gw: &RunningGateway,
    addr: SocketAddr,
    n: usize,
    ca: Option<&Path>,
    ws: bool,
) -> (f64, tokio::process::Child) {
    let before = rss_kib();
    let child = open_idle(gw, addr, n, ca, ws).await;
    let after = rss_kib();
    (
        (after.saturating_sub(before)) as f64 * 1024.0 / n as f64,
        child,
    )
}

async fn close_idle(gw: &RunningGateway, children: Vec<tokio::process::Child>) {
    for mut c in children {
        drop(c.stdin.take());
        let _ = c.wait().await;
    }
    common::wait_until("devices gone", Duration::from_secs(20), || {
        gw.status_json()["devices"].as_i64().unwrap_or(0) == 0
    })
    .await;
}

/// Measures this process's RSS, so it must run alone:
/// `cargo test -p sluice --test gateway_tls -- --ignored --nocapture idle_connection_memory`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: run alone (RSS of the whole test process)"]
async fn idle_connection_memory_by_transport() {
    const N: usize = 500;
    let pki = TestPki::generate();
    let extra = format!(
        "{}[mqtt.ws]\nlisten = \"127.0.0.1:0\"\n",
        tls_section(&pki, "")
    );
    let gw = start("", &extra);
    // Warm up allocator arenas and lazily built state on each path with a first round,
    // kept open: memory freed before a measurement would be reused by it and hide its cost.
    let warm = vec![
        open_idle(&gw, gw.mqtt_addr, 50, None, false).await,
        open_idle(
            &gw,
            gw.tls_addr.expect("tls"),
            50,
            Some(pki.ca_path()),
            false,
        )
        .await,
        open_idle(&gw, gw.ws_addr.expect("ws"), 50, None, true).await,
    ];
    let (plain, a) = idle_cost(&gw, gw.mqtt_addr, N, None, false).await;
    let (tls, b) = idle_cost(
        &gw,
        gw.tls_addr.expect("tls"),
        N,
        Some(pki.ca_path()),
        false,
    )
    .await;
    let (ws, c) = idle_cost(&gw, gw.ws_addr.expect("ws"), N, None, true).await;
    let mut all = warm;
    all.extend([a, b, c]);
    close_idle(&gw, all).await;
    println!(
        "idle connection cost over {N} connections (RSS growth / N): plain {:.0} B, tls {:.0} B, ws {:.0} B",
        plain, tls, ws
    );
    // Loose bounds: a regression that holds a read buffer or rustls' handshake state per idle
    // connection would show.
    assert!(tls < 48.0 * 1024.0, "idle TLS connection costs {tls:.0} B");
    assert!(
        ws < 24.0 * 1024.0,
        "idle WebSocket connection costs {ws:.0} B"
    );
    gw.shutdown();
}
