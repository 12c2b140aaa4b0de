//! `scenario priority` at tiny scale: every mode runs through its own network namespaces, the
//! report has every mode and every device, and nothing is lost. Needs root (namespaces, veth,
//! tc); prints a skip line otherwise.

mod sluice_binary;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use sluice_bench::load::devices::PayloadSize;
use sluice_bench::scenarios::priority::{markdown, run_priority, Mode, PriorityScenario};

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| sluice_bench::harness::netns::effective_uid(&s))
        == Some(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_runs_in_its_own_namespaces_and_loses_nothing() -> anyhow::Result<()> {
    if !is_root() {
        eprintln!(
            "SKIPPED every_mode_runs_in_its_own_namespaces_and_loses_nothing: scenario priority \
             needs root (network namespaces, veth, tc); CI runs it as root"
        );
        return Ok(());
    }
    let mut config = PriorityScenario::new(
        sluice_binary::built_now(),
        PathBuf::from(env!("CARGO_BIN_EXE_sluice-bench")),
    );
    config.rate_per_device = 50.0;
    config.payload = PayloadSize { min: 200, max: 200 };
    config.link_rate = "1mbit".to_string();
    config.duration = Duration::from_secs(2);
    config.warmup = Duration::from_millis(500);
    config.drain_idle = Duration::from_secs(1);
    config.drain_max = Duration::from_secs(10);
    config.command_line = "test".to_string();
    config.verbose = false;
    let started = Instant::now();
    let report = run_priority(&config).await?;
    eprintln!("{}", markdown(&report));
    eprintln!("took {:.1} s", started.elapsed().as_secs_f64());

    let modes: Vec<Mode> = report.modes.iter().map(|m| m.mode).collect();
    assert_eq!(modes, Mode::all());
    for m in &report.modes {
        let expected_devices = if m.mode == Mode::Unloaded { 1 } else { 4 };
        assert_eq!(m.devices.len(), expected_devices, "{}", m.mode.name());
        assert_eq!(
            m.devices.iter().filter(|d| d.high).count(),
            1,
            "{}: one high device",
            m.mode.name()
        );
        assert!(m.sent >= 50, "{}: sent only {}", m.mode.name(), m.sent);
        assert_eq!(m.lost, 0, "{}: {} lost", m.mode.name(), m.lost);
        for d in &m.devices {
            assert_eq!(d.lost, Some(0), "{} {}", m.mode.name(), d.client_id);
            assert!(d.sent > 0, "{} {}", m.mode.name(), d.client_id);
            assert!(d.e2e_p99_ms.is_some_and(|p| p > 0.0), "{d:?}");
        }
        if m.mode == Mode::LanesTc || m.mode == Mode::Unloaded {
            assert!(m.link_setup.is_empty(), "sluice installs tc itself");
            assert!(
                m.tc_stats.contains("class htb 1:10"),
                "sluice's htb tree was in place:\n{}",
                m.tc_stats
            );
        } else {
            assert!(m.tc_stats.contains("qdisc htb 1: root"), "{}", m.tc_stats);
        }
    }
    assert!(report
        .verdicts
        .iter()
        .any(|v| v.name.starts_with("nothing lost") && v.pass == Some(true)));
    // Namespaces are gone.
    let list = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()?;
    let list = String::from_utf8_lossy(&list.stdout);
    let own = format!("-{}-", std::process::id());
    assert!(
        !list
            .lines()
            .any(|l| l.starts_with("slp-") && l.contains(&own)),
        "namespaces left behind:\n{list}"
    );
    Ok(())
}
