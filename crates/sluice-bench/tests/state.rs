//! The `state` scenario, small: both load modes deliver, the "on" mode writes state records,
//! and after kill -9 every sampled persistent session is back with its queued message.

mod sluice_binary;

use std::time::Duration;

use sluice_bench::scenarios::state::{markdown, run_state, StateScenario};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_scenario_measures_both_modes_and_a_restart() {
    let mut s = StateScenario::new(sluice_binary::built_now());
    s.devices = 8;
    s.warmup = Duration::from_secs(1);
    s.window = Duration::from_secs(2);
    s.retained = 300;
    s.sessions = 40;
    s.work_dir = std::env::temp_dir();
    let r = run_state(&s, "test").await.expect("the scenario runs");
    assert_eq!(r.load.len(), 2);
    for l in &r.load {
        assert!(l.delivered > 0, "{} delivered nothing", l.mode);
    }
    assert_eq!(r.load[0].state_records, 0, "no state without [state]");
    assert!(
        r.load[1].state_records > 0,
        "persistent sessions write state"
    );
    let x = r.restart.as_ref().expect("the restart part ran");
    assert_eq!(
        (x.restored_sessions_metric, x.restored_retained_metric),
        (40, 300)
    );
    assert_eq!(x.sampled_sessions_ok, x.sampled);
    assert!(markdown(&r).contains("Restart after kill -9"));
}
