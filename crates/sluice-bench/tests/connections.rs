//! The `connections` scenario at tiny scale: 50 idle devices against sluice, once from this
//! process and once spread over two `sluice-bench idle` child processes.

mod sluice_binary;

use std::path::PathBuf;

use sluice_bench::scenarios::connections::{run_connections, ConnectionsScenario, EdgeSut};

fn scenario(per_process: u32) -> ConnectionsScenario {
    let mut config = ConnectionsScenario::new(
        sluice_binary::debug_or_release(),
        PathBuf::from(env!("CARGO_BIN_EXE_sluice-bench")),
    );
    config.suts = vec![EdgeSut::Sluice];
    config.n = Some(50);
    config.per_process = per_process;
    config.probe_beyond = 5;
    config.sluice_shards = 1;
    config.command_line = "test".to_string();
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_idle_devices_all_connect_to_sluice_and_each_costs_some_rss() -> anyhow::Result<()> {
    let report = run_connections(&scenario(1000)).await?;
    let run = &report.runs[0];
    assert_eq!(run.worker_processes, 1);
    assert_eq!(
        (run.connected, run.failed, run.dropped_while_held),
        (50, 0, 0),
        "{run:#?}"
    );
    assert!(run.rss_per_connection_kib > 0.0, "{run:#?}");
    assert!(
        run.sut_open_fds_connected >= run.sut_open_fds_before + 50,
        "sluice holds one socket per device: {run:#?}"
    );
    assert!(run.sut_fd_limit.soft > 50);
    assert_eq!(run.connack_latency.count, 50);
    assert!(run.connect_rate_per_s > 0.0);
    assert!(report.tool_fd_limit.after.soft >= report.tool_fd_limit.before.soft);
    let probe = run
        .probe
        .as_ref()
        .expect("5 connections beyond N were tried");
    assert_eq!(
        (probe.connected, probe.failed),
        (5, 0),
        "far below the limit: {probe:?}"
    );
    let table = sluice_bench::scenarios::connections::markdown(&report);
    assert!(table.contains("RSS per idle connection"), "{table}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_devices_spread_over_two_worker_processes_all_connect() -> anyhow::Result<()> {
    let report = run_connections(&scenario(25)).await?;
    let run = &report.runs[0];
    assert_eq!(run.worker_processes, 2);
    assert_eq!((run.connected, run.failed), (50, 0), "{run:#?}");
    assert_eq!(run.connack_latency.count, 50);
    Ok(())
}
