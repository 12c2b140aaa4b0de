use super::report::*;
use super::*;

#[test]
fn stale_namespace_names_carry_the_pid_of_their_run() {
    assert_eq!(stale_namespace_pid("slp-gw-1234-0"), Some(1234));
    assert_eq!(stale_namespace_pid("slp-cloud-77-12"), Some(77));
    assert_eq!(stale_namespace_pid("slp-gw-1234"), None);
    assert_eq!(stale_namespace_pid("sluice-tc-1-0"), None);
    assert_eq!(stale_namespace_pid("slp-gw-x-0"), None);
}

#[test]
fn the_effective_uid_is_the_second_uid_field() {
    assert_eq!(effective_uid("Name:\tx\nUid:\t1000\t0\t0\t0\n"), Some(0));
    assert_eq!(effective_uid("Uid:\t0\t1000\t1000\t1000\n"), Some(1000));
    assert_eq!(effective_uid("Name:\tx\n"), None);
}

#[test]
fn colour_codes_are_stripped_from_logs() {
    assert_eq!(
        strip_ansi("\u{1b}[2m2026\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m up \u{1b}[3mshard\u{1b}[0m\u{1b}[2m=\u{1b}[0m0"),
        "2026  INFO up shard=0"
    );
}

#[test]
fn link_rates_are_tc_rates() {
    assert_eq!(link_rate_bits("2mbit"), Some(2e6));
    assert_eq!(link_rate_bits("512Kbit"), Some(512e3));
    assert_eq!(link_rate_bits("250kbps"), Some(2e6));
    assert!(!valid_link_rate("2"));
    assert!(!valid_link_rate("fast"));
    assert!(!valid_link_rate("0mbit"));
}

fn row(client_id: &str, high: bool, sent: u64, delivered: u64, mean: f64, p99: f64) -> DeviceRow {
    DeviceRow {
        device: 0,
        client_id: client_id.to_string(),
        high,
        sent,
        acknowledged: sent,
        delivered: Some(delivered),
        lost: Some(sent as i64 - delivered as i64),
        skipped: None,
        e2e_mean_ms: Some(mean),
        e2e_p50_ms: Some(mean),
        e2e_p99_ms: Some(p99),
        e2e_max_ms: Some(p99),
        ack_mean_ms: 0.0,
        ack_p99_ms: 0.0,
    }
}

fn mode(mode: Mode, devices: Vec<DeviceRow>) -> ModeRun {
    let sent = devices.iter().map(|d| d.sent).sum::<u64>();
    let delivered = devices
        .iter()
        .map(|d| d.delivered.unwrap_or(0))
        .sum::<u64>();
    ModeRun {
        mode,
        description: String::new(),
        devices,
        sent,
        acknowledged: sent,
        delivered,
        lost: sent as i64 - delivered as i64,
        duplicates: 0,
        order_violations: 0,
        skipped_inflight_full: 0,
        device_reconnects: 0,
        device_connect_failures: 0,
        high_session_seen: true,
        link_setup: Vec::new(),
        tc_stats: String::new(),
        sluice_config: String::new(),
        sluice_log_tail: String::new(),
        warmup_sent: 0,
        measured_s: 1.0,
        loadavg_start: String::new(),
        loadavg_end: String::new(),
        devices_report: serde_json::Value::Null,
        sink_report: serde_json::Value::Null,
    }
}

#[test]
fn verdicts_are_computed_from_the_measured_latencies() {
    let modes = vec![
        mode(
            Mode::Unloaded,
            vec![row("bench-hi-0", true, 100, 100, 4.0, 8.0)],
        ),
        mode(
            Mode::Off,
            vec![
                row("bench-hi-0", true, 100, 100, 200.0, 400.0),
                row("bench-1", false, 100, 100, 400.0, 800.0),
            ],
        ),
        mode(
            Mode::LanesTc,
            vec![
                row("bench-hi-0", true, 100, 100, 6.0, 12.0),
                row("bench-1", false, 100, 100, 500.0, 900.0),
                row("bench-2", false, 100, 99, 500.0, 79.0),
            ],
        ),
    ];
    let v = verdicts(&modes);
    assert_eq!(v[0].pass, Some(true), "{:?}", v[0]);
    assert!(v[0].measured.starts_with("12.00 ms (1.50×)"), "{:?}", v[0]);
    assert_eq!(v[1].pass, Some(false), "79 ms < 10 × 8 ms: {:?}", v[1]);
    assert_eq!(v[2].pass, Some(false), "one message lost: {:?}", v[2]);
    assert!(v[2].measured.contains("lanes+tc 1"), "{:?}", v[2]);
    assert_eq!(v[3].measured, "not run");
    assert!(
        v[4].measured
            .contains("avg 200.00 → 6.00 ms (-97 %), p99 400.00 → 12.00 ms (-97 %)"),
        "{:?}",
        v[4]
    );
}

#[test]
fn without_the_baseline_the_target_verdicts_are_not_run() {
    let modes = vec![mode(
        Mode::Off,
        vec![row("bench-hi-0", true, 10, 10, 1.0, 2.0)],
    )];
    let v = verdicts(&modes);
    assert_eq!(v[0].pass, None);
    assert_eq!(v[1].pass, None);
    assert_eq!(v[2].pass, Some(true));
}

#[test]
fn the_sink_per_device_entries_may_name_the_device_by_number_or_string() {
    let j: DeviceLatencyJson = serde_json::from_str(
        r#"{"device": 3, "received": 5, "mean_ms": 1.0, "p50_ms": 1.0, "p99_ms": 2.0, "max_ms": 3.0}"#,
    )
    .unwrap();
    assert_eq!(j.device(), Some(3));
    let j: DeviceLatencyJson = serde_json::from_str(
        r#"{"device": "2", "received": 5, "mean_ms": 1.0, "p50_ms": 1.0, "p99_ms": 2.0, "max_ms": 3.0}"#,
    )
    .unwrap();
    assert_eq!(j.device(), Some(2));
}

#[test]
fn the_off_mode_config_has_no_priority_and_lanes_tc_installs_tc() {
    let pki = TestPki::try_generate().unwrap();
    let cancel = AtomicBool::new(false);
    let cancel = Cancel(&cancel);
    let net = Namespaces {
        gw: String::new(),
        cloud: String::new(),
    };
    let config = PriorityScenario::new(PathBuf::from("sluice"), PathBuf::from("bench"));
    let ctx = Ctx {
        config: &config,
        cancel: &cancel,
        net: &net,
        pki: &pki,
        work: Path::new("/tmp"),
        sluice_bin: Path::new("sluice"),
        bench_bin: Path::new("bench"),
        per_device_sink: true,
        pdeathsig: false,
    };
    let off = ctx.sluice_config(Mode::Off);
    assert!(!off.contains("[priority]"), "{off}");
    assert!(!off.contains("install_tc"), "{off}");
    assert!(off.contains("[uplink.aggregate]\nenabled = false"), "{off}");
    let lanes = ctx.sluice_config(Mode::Lanes);
    assert!(
        lanes.contains("[priority]\ndevices = { \"bench-hi-*\" = 1 }"),
        "{lanes}"
    );
    assert!(!lanes.contains("install_tc"), "{lanes}");
    let tc = ctx.sluice_config(Mode::LanesTc);
    assert!(
        tc.contains("install_tc = true\ntc_interface = \"veth0\"\ntc_rate = \"2mbit\""),
        "{tc}"
    );
}
