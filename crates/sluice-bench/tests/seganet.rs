//! The `seganet` scenario and its parts: a tiny sweep against every system under test, chart
//! output, the per-device agent's acknowledgement rule, and the admission and verdict rules.

mod sluice_binary;

use std::path::PathBuf;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use sluice_bench::conn::{handshake, read_packet, send};
use sluice_bench::harness::agents::{run_agent, AgentConfig};
use sluice_bench::harness::cgroup::parse_cgroup_mounts;
use sluice_bench::harness::limits::{admit_agents, Limits};
use sluice_bench::load::devices::PayloadSize;
use sluice_bench::report::charts::{write_png, Chart, ChartPoint, Series, SIZE};
use sluice_bench::scenarios::seganet::{
    limited_by, run_seganet, PointStatus, ReportFiles, SegaSut, SeganetScenario, Verdict,
};
use sluice_proto::mqtt::{
    ConnAck, Connect, Decoder, Packet, Properties, ProtocolVersion, PubResponse, Publish, QoS,
};
use sluice_testkit::TestPki;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::time::timeout;
use tokio_rustls::TlsAcceptor;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_sweep_delivers_everything_through_sluice_the_agents_and_the_bridge(
) -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let config = SeganetScenario {
        ns: vec![4],
        suts: SegaSut::all(),
        rate_per_device: 10.0,
        payload: PayloadSize {
            min: 100,
            max: 1024,
        },
        qos: QoS::AtLeastOnce,
        duration: Duration::from_secs(2),
        ramp: Duration::from_millis(300),
        settle: Duration::from_millis(200),
        constrained: None,
        sluice_bin: sluice_binary::debug_or_release(),
        sluice_shards: 1,
        // Aggregate even 4 devices, so the sink's SenML unpacking is on the path.
        sluice_aggregate: sluice_bench::harness::sut::AggregateOpts {
            min_devices: 0,
            max_delay: "200ms".to_string(),
            ..Default::default()
        },
        agent_bin: PathBuf::from(env!("CARGO_BIN_EXE_sluice-bench")),
        memory_fraction: 0.6,
        drain_idle: Duration::from_secs(2),
        drain_max: Duration::from_secs(5),
        command_line: "test".to_string(),
        progress_every: None,
        out: Some(ReportFiles {
            dir: out.path().to_path_buf(),
            name: "seganet".to_string(),
        }),
    };
    let report = run_seganet(&config).await?;
    assert_eq!(report.points.len(), 3);
    for point in &report.points {
        assert_eq!(
            point.status,
            PointStatus::Measured,
            "{} N=4: {:?}",
            point.sut.name(),
            point.reason
        );
        let m = point.measurement.as_ref().expect("measured point");
        assert!(
            m.sent >= 4 * 10,
            "{}: sent only {}",
            point.sut.name(),
            m.sent
        );
        assert_eq!(m.delivery_ratio, 1.0, "{}: {m:?}", point.sut.name());
        assert_eq!((m.duplicates, m.order_violations), (0, 0));
        assert_eq!(
            m.acknowledged,
            m.sent,
            "{}: every PUBLISH acked",
            point.sut.name()
        );
        let processes = if point.sut == SegaSut::Agents { 4 } else { 1 };
        assert_eq!(m.sut_processes, processes);
        assert!(m.sut_rss_peak_kib > 0 && m.sut_pss_end_kib > 0);
        assert!(m.e2e_latency.p99_ms > 0.0);
    }
    for suffix in [".json", ".md", "-p99.png", "-cpu.png", "-rss.png"] {
        let path = out.path().join(format!("seganet{suffix}"));
        assert!(
            std::fs::metadata(&path)?.len() > 0,
            "{} was written",
            path.display()
        );
    }
    let md = std::fs::read_to_string(out.path().join("seganet.md"))?;
    assert!(md.contains("| agents | 4 | 4 |"), "{md}");
    assert!(md.contains("![p99 end-to-end latency"), "{md}");
    Ok(())
}

#[test]
fn a_chart_from_a_hand_made_data_set_is_a_valid_png() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("chart.png");
    let line = |label: &str, base: f64| Series {
        label: label.to_string(),
        points: [1u32, 16, 64, 256, 1024, 4096, 16384]
            .iter()
            .map(|&n| ChartPoint {
                n: f64::from(n),
                value: base * (1.0 + f64::from(n).log2()),
                hollow: n >= 4096,
            })
            .collect(),
    };
    let chart = Chart {
        title: "p99 latency vs devices".to_string(),
        y_label: "ms".to_string(),
        log_y: true,
        footnote: Some("hollow: generator-limited".to_string()),
        series: vec![
            line("sluice", 0.5),
            line("agents", 2.0),
            line("bridge", 1.0),
        ],
    };
    write_png(&chart, &path)?;
    let bytes = std::fs::read(&path)?;
    assert!(
        bytes.len() > 1000,
        "a real picture, not {} bytes",
        bytes.len()
    );
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&bytes[12..16], b"IHDR");
    let width = u32::from_be_bytes(bytes[16..20].try_into()?);
    let height = u32::from_be_bytes(bytes[20..24].try_into()?);
    assert_eq!((width, height), SIZE);

    // No drawable point at all (empty sweep, log axis, zero values) still gives a PNG.
    let empty = Chart {
        series: vec![Series {
            label: "none".to_string(),
            points: vec![ChartPoint {
                n: 4.0,
                value: 0.0,
                hollow: false,
            }],
        }],
        ..chart
    };
    write_png(&empty, &path)?;
    assert_eq!(&std::fs::read(&path)?[..8], b"\x89PNG\r\n\x1a\n");
    Ok(())
}

/// A TLS 1.3 "cloud" that speaks just enough MQTT for the agent and lets the test decide when
/// (and whether) to acknowledge.
struct FakeCloud {
    listener: TcpListener,
    acceptor: TlsAcceptor,
}

type CloudStream = tokio_rustls::server::TlsStream<TcpStream>;

struct CloudSession {
    io: CloudStream,
    rbuf: BytesMut,
    wbuf: BytesMut,
    decoder: Decoder,
}

impl FakeCloud {
    async fn start(pki: &TestPki) -> anyhow::Result<FakeCloud> {
        Ok(FakeCloud {
            listener: TcpListener::bind("127.0.0.1:0").await?,
            acceptor: TlsAcceptor::from(pki.rustls_server_config(false)),
        })
    }

    /// Accept the agent's session: TLS, CONNECT, CONNACK.
    async fn accept(&self) -> anyhow::Result<(CloudSession, Connect)> {
        let (tcp, _) = self.listener.accept().await?;
        let io = self.acceptor.accept(tcp).await?;
        let mut s = CloudSession {
            io,
            rbuf: BytesMut::new(),
            wbuf: BytesMut::new(),
            decoder: Decoder::server(1 << 20),
        };
        let Packet::Connect(connect) = s.read().await? else {
            anyhow::bail!("the agent did not start with CONNECT");
        };
        s.send(&Packet::ConnAck(ConnAck {
            session_present: false,
            code: 0,
            properties: Properties::default(),
        }))
        .await?;
        Ok((s, connect))
    }
}

impl CloudSession {
    async fn read(&mut self) -> anyhow::Result<Packet> {
        read_packet(&mut self.io, &mut self.rbuf, &mut self.decoder).await
    }
    async fn read_publish(&mut self) -> anyhow::Result<Publish> {
        loop {
            match timeout(Duration::from_secs(5), self.read()).await?? {
                Packet::Publish(p) => return Ok(p),
                Packet::PingReq => continue,
                other => anyhow::bail!("expected PUBLISH, got {}", other.name()),
            }
        }
    }
    async fn send(&mut self, packet: &Packet) -> anyhow::Result<()> {
        send(&mut self.io, packet, ProtocolVersion::V311, &mut self.wbuf).await
    }
}

/// A device connected to an agent (plain TCP, MQTT 3.1.1).
struct Device {
    tcp: TcpStream,
    rbuf: BytesMut,
    wbuf: BytesMut,
    decoder: Decoder,
}

impl Device {
    async fn connect(addr: std::net::SocketAddr) -> anyhow::Result<Device> {
        let mut d = Device {
            tcp: TcpStream::connect(addr).await?,
            rbuf: BytesMut::new(),
            wbuf: BytesMut::new(),
            decoder: Decoder::client(ProtocolVersion::V311, 1 << 20),
        };
        let connect = Connect {
            protocol: ProtocolVersion::V311,
            clean_start: true,
            keep_alive: 60,
            client_id: "device-0".into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        };
        handshake(
            &mut d.tcp,
            connect,
            &mut d.rbuf,
            &mut d.wbuf,
            &mut d.decoder,
            Duration::from_secs(5),
        )
        .await?;
        Ok(d)
    }

    async fn publish(&mut self, packet_id: u16, payload: &'static [u8]) -> anyhow::Result<()> {
        let publish = Publish {
            dup: false,
            qos: QoS::AtLeastOnce,
            retain: false,
            topic: "dev/0".into(),
            packet_id: Some(packet_id),
            properties: None,
            payload: Bytes::from_static(payload),
        };
        send(
            &mut self.tcp,
            &Packet::Publish(publish),
            ProtocolVersion::V311,
            &mut self.wbuf,
        )
        .await
    }

    /// The next packet within `wait`, or `None` if nothing came.
    async fn next_within(&mut self, wait: Duration) -> anyhow::Result<Option<Packet>> {
        match timeout(
            wait,
            read_packet(&mut self.tcp, &mut self.rbuf, &mut self.decoder),
        )
        .await
        {
            Ok(packet) => Ok(Some(packet?)),
            Err(_) => Ok(None),
        }
    }
}

/// Start an agent on this runtime; dropping the sender stops it.
async fn start_agent(
    cloud: std::net::SocketAddr,
    pki: &TestPki,
) -> anyhow::Result<(std::net::SocketAddr, oneshot::Sender<()>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let config = AgentConfig::new(
        cloud,
        pki.ca_path().to_path_buf(),
        "agent-under-test".into(),
    );
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        if let Err(e) = run_agent(listener, config, shutdown).await {
            panic!("agent failed: {e:#}");
        }
    });
    Ok((addr, stop))
}

#[tokio::test]
async fn the_agent_acks_the_device_only_after_the_cloud_acks() -> anyhow::Result<()> {
    let pki = TestPki::try_generate()?;
    let cloud = FakeCloud::start(&pki).await?;
    let (agent, _stop) = start_agent(cloud.listener.local_addr()?, &pki).await?;
    let (mut session, connect) = cloud.accept().await?;
    assert_eq!(&*connect.client_id, "agent-under-test");

    let mut device = Device::connect(agent).await?;
    device.publish(7, b"reading 1").await?;
    let forwarded = session.read_publish().await?;
    assert_eq!(&*forwarded.topic, "dev/0");
    assert_eq!(&forwarded.payload[..], b"reading 1");
    assert_eq!(forwarded.qos, QoS::AtLeastOnce);

    assert!(
        device
            .next_within(Duration::from_millis(500))
            .await?
            .is_none(),
        "no PUBACK to the device while the cloud has not acknowledged"
    );
    let cloud_id = forwarded.packet_id.expect("QoS 1 has a packet id");
    session
        .send(&Packet::PubAck(PubResponse {
            packet_id: cloud_id,
            reason: 0,
            properties: None,
        }))
        .await?;
    match device.next_within(Duration::from_secs(5)).await? {
        Some(Packet::PubAck(ack)) => assert_eq!(ack.packet_id, 7, "the device's own packet id"),
        other => panic!("expected the device's PUBACK after the cloud's, got {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn with_the_cloud_unreachable_the_agent_accepts_the_device_but_never_acks(
) -> anyhow::Result<()> {
    let pki = TestPki::try_generate()?;
    // A port nothing listens on: connections are refused.
    let closed = TcpListener::bind("127.0.0.1:0").await?.local_addr()?;
    let (agent, _stop) = start_agent(closed, &pki).await?;
    let mut device = Device::connect(agent).await?;
    device.publish(1, b"reading").await?;
    device.publish(2, b"reading").await?;
    assert!(
        device
            .next_within(Duration::from_millis(1500))
            .await?
            .is_none(),
        "no PUBACK may reach the device while the cloud is unreachable"
    );
    Ok(())
}

#[tokio::test]
async fn the_agent_resends_unacknowledged_messages_when_the_cloud_session_comes_back(
) -> anyhow::Result<()> {
    let pki = TestPki::try_generate()?;
    let cloud = FakeCloud::start(&pki).await?;
    let (agent, _stop) = start_agent(cloud.listener.local_addr()?, &pki).await?;
    let (mut first, _) = cloud.accept().await?;
    let mut device = Device::connect(agent).await?;
    device.publish(42, b"must survive").await?;
    let original = first.read_publish().await?;
    assert!(!original.dup);
    drop(first); // the cloud session dies before acknowledging

    let (mut second, _) = timeout(Duration::from_secs(5), cloud.accept()).await??;
    let again = second.read_publish().await?;
    assert!(again.dup, "a resent PUBLISH carries DUP");
    assert_eq!(again.payload, original.payload);
    assert!(device
        .next_within(Duration::from_millis(200))
        .await?
        .is_none());
    second
        .send(&Packet::PubAck(PubResponse {
            packet_id: again.packet_id.expect("QoS 1"),
            reason: 0,
            properties: None,
        }))
        .await?;
    match device.next_within(Duration::from_secs(5)).await? {
        Some(Packet::PubAck(ack)) => assert_eq!(ack.packet_id, 42),
        other => panic!("expected PUBACK 42, got {other:?}"),
    }
    Ok(())
}

fn limits(mem_available_gib: u64) -> Limits {
    Limits {
        mem_available_kib: mem_available_gib << 20,
        pid_max: 32_768,
        threads_max: 192_731,
        max_user_processes: 96_365,
        max_open_files: 20_000,
        tasks_now: 200,
        ephemeral_ports: 28_232,
    }
}

#[test]
fn agent_points_that_would_not_fit_in_memory_pids_or_ports_are_refused_with_a_reason() {
    // 4 MiB per agent, 24 GiB available, 60 %: 14.4 GiB → up to ~3,686 agents.
    assert!(admit_agents(1024, 4096, &limits(24), 0.6).is_ok());
    let memory = admit_agents(4096, 4096, &limits(24), 0.6).expect_err("16 GiB > 14.4 GiB");
    assert!(memory.contains("MemAvailable"), "{memory}");
    // 1 KiB each always fits in memory, but 30,000 processes do not fit 80 % of pid_max.
    let pids = admit_agents(30_000, 1, &limits(24), 0.6).expect_err("over the pid bound");
    assert!(pids.contains("process limit"), "{pids}");
    // 14,000 fit the pid bound, but not two local ports each in a 28,232-port range.
    let ports = admit_agents(14_000, 1, &limits(24), 0.6).expect_err("over the port range");
    assert!(ports.contains("ephemeral range"), "{ports}");
}

#[test]
fn the_cpu_controller_is_found_in_a_v1_hierarchy_when_cgroup_v2_lacks_it() {
    let mounts = "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\n\
                  cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n\
                  cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0\n\
                  cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";
    let found = parse_cgroup_mounts(mounts, |_| false);
    assert_eq!(
        found.v2,
        Some((PathBuf::from("/sys/fs/cgroup/unified"), false))
    );
    assert_eq!(found.v1_cpu, Some(PathBuf::from("/sys/fs/cgroup/cpu")));
    let pure_v2 = parse_cgroup_mounts("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n", |_| true);
    assert_eq!(pure_v2.v2, Some((PathBuf::from("/sys/fs/cgroup"), true)));
    assert_eq!(pure_v2.v1_cpu, None);
}

#[test]
fn the_verdict_names_what_held_a_point_below_its_offered_load() {
    let base = Verdict {
        offered_rate: 10_000.0,
        achieved_rate: 9_900.0,
        acked_rate: 9_900.0,
        skipped_share: 0.0,
        tool_cpu_percent: 60.0,
        sut_cpu_percent: 30.0,
        machine_busy_percent: 50.0,
        quota_percent: None,
    };
    assert_eq!(limited_by(&base), "-");
    let behind = Verdict {
        acked_rate: 5_000.0,
        ..base
    };
    assert!(limited_by(&behind).starts_with("SUT falling behind (acked 51%"));
    let generator = Verdict {
        achieved_rate: 6_000.0,
        acked_rate: 6_000.0,
        ..base
    };
    assert!(limited_by(&generator).starts_with("load generator (60% of offered"));
    let saturated = Verdict {
        machine_busy_percent: 97.0,
        ..generator
    };
    assert!(limited_by(&saturated).starts_with("machine CPU saturated"));
    let backpressure = Verdict {
        skipped_share: 0.3,
        sut_cpu_percent: 49.0,
        quota_percent: Some(50),
        ..generator
    };
    let text = limited_by(&backpressure);
    assert!(
        text.starts_with("SUT backpressure") && text.contains("50% CPU quota"),
        "{text}"
    );
}
