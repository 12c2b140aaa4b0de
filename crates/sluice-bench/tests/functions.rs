//! The `functions` scenario at tiny scale: the prediction part (library only), and the adaptor
//! and warm-start parts with the function as a remote one the bench starts itself (the compiled
//! `sluice-bench fn-echo`), so every event goes MQTT → sluice's dispatcher → the function and
//! its reply comes back on the reply topic; the adaptor part's floor row sends the same load
//! through `sluice-bench fn-floor` to another instance.

mod sluice_binary;

use std::path::PathBuf;
use std::time::Duration;

use sluice_bench::scenarios::functions::adaptor::Adaptor;
use sluice_bench::scenarios::functions::{
    markdown, run_functions, FnKind, FunctionsScenario, Part, Placement,
};

fn scenario(parts: Vec<Part>) -> FunctionsScenario {
    let mut s = FunctionsScenario::new(
        sluice_binary::debug_or_release(),
        PathBuf::from(env!("CARGO_BIN_EXE_sluice-bench")),
    );
    s.parts = parts;
    s.command_line = "test".into();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_trace_goes_through_every_policy_and_always_warm_is_never_cold() -> anyhow::Result<()>
{
    let report = run_functions(&scenario(vec![Part::Predict])).await?;
    let p = report.predict.as_ref().expect("the predict part ran");
    assert_eq!(p.rows.len(), 5 * 5);
    for row in p.rows.iter().filter(|r| r.policy == "always-warm") {
        assert_eq!(row.cold_starts, 0, "{row:?}");
        assert!((row.warm_percent_of_always - 100.0).abs() < 1e-9);
    }
    assert!(markdown(&report).contains("| periodic | gbdt |"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_compiled_echo_answers_every_event_and_its_replies_come_back() -> anyhow::Result<()>
{
    let mut s = scenario(vec![Part::Adaptor, Part::Cold]);
    s.kinds = vec![FnKind::Compiled];
    s.placement = Placement::Remote;
    s.adaptor_rate = 100.0;
    s.adaptor_devices = 2;
    s.adaptor_warmup = Duration::from_secs(1);
    s.adaptor_window = Duration::from_secs(2);
    s.warm_rounds = 5;
    let report = run_functions(&s).await?;
    assert_eq!(
        report.adaptor.len(),
        3,
        "the baseline, then the function through sluice, then through the floor"
    );
    let base = &report.adaptor[0];
    assert!(base.function.is_none() && base.all_answered, "{base:#?}");
    assert!(
        base.events_ok > 100 && base.invocations_ok == 0,
        "{base:#?}"
    );
    let a = &report.adaptor[1];
    assert!(a.all_answered, "{a:#?}");
    assert!(a.events_ok > 100, "{a:#?}");
    assert!(a.adaptor_us_per_event.is_some() && a.function_us_per_event.is_some());
    let f = &report.adaptor[2];
    assert_eq!(
        (f.adaptor, f.function),
        (Adaptor::Floor, Some(FnKind::Compiled))
    );
    assert!(f.all_answered && f.events_ok > 100, "{f:#?}");
    assert!(f.adaptor_us_per_event.is_some() && f.function_us_per_event.is_some());
    assert_eq!(
        f.instance_pids.len(),
        1,
        "the one instance the bench started"
    );
    // no Python row, so no Python ratios, and the table has the floor's row
    assert_eq!(report.adaptor_floor_share_of_python, None);
    assert!(markdown(&report).contains("| floor (minimal MQTT→HTTP relay) | compiled |"));
    let c = &report.cold[0];
    assert_eq!(
        (c.cold.rounds, c.warm.rounds, c.warm.lost),
        (0, 5, 0),
        "{c:#?}"
    );
    assert_eq!(c.warm.publish_to_function.count, 5);
    assert_eq!(
        c.warm.instances_seen, 1,
        "one instance served every warm event"
    );
    assert_eq!(c.warm.sluice_dispatch.count, 5, "{c:#?}");
    assert!(markdown(&report).contains("## Adaptor cost"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_starts_a_compiled_echo_per_cold_event_and_scales_it_to_zero() -> anyhow::Result<()>
{
    let mut s = scenario(vec![Part::Cold, Part::Idle]);
    s.kinds = vec![FnKind::Compiled];
    s.cold_rounds = 2;
    s.warm_rounds = 3;
    s.idle_devices = 3;
    s.idle_window = Duration::from_secs(2);
    let report = run_functions(&s).await?;
    let c = &report.cold[0];
    assert_eq!((c.cold.lost, c.warm.lost), (0, 0), "{c:#?}");
    assert_eq!(
        c.cold.instances_seen, 2,
        "a new instance for each cold event"
    );
    assert_eq!(c.warm.instances_seen, 1, "one instance for the warm events");
    assert_eq!(c.cold.sluice_cold_start.count, 2, "{c:#?}");
    assert_eq!(c.cold.sluice_dispatch.count, 2, "{c:#?}");
    // the function's main began after the event was published, and read it after that
    assert!(c.cold.publish_to_main.p50_ms.unwrap() > 0.0, "{c:#?}");
    assert!(c.cold.function_startup.p50_ms.unwrap() > 0.0, "{c:#?}");
    assert_eq!(
        c.spawn_to_main.count, 2,
        "the start-up floor, once per cold round"
    );
    let i = report.idle.as_ref().expect("the idle part ran");
    assert_eq!(i.devices_connected, 3);
    assert_eq!(i.children_at_end, 0, "scaled to zero");
    assert!(
        i.threads.iter().any(|t| t.comm.starts_with("sluice")),
        "{i:#?}"
    );
    Ok(())
}
