//! Tests of the tc module: command lines, parsing, failure classification, the worker.

use super::*;
use std::sync::atomic::{AtomicU32, Ordering};

#[test]
fn route_get_output_names_the_interface_after_dev() {
    assert_eq!(
        parse_route_dev("10.0.0.2 dev veth0 src 10.0.0.1 uid 0 \\    cache "),
        Some("veth0".to_string())
    );
    assert_eq!(
        parse_route_dev("1.1.1.1 via 192.168.1.1 dev wlp2s0 src 192.168.1.7 uid 1000 \\    cache"),
        Some("wlp2s0".to_string())
    );
    assert_eq!(
        parse_route_dev("local 127.0.0.1 dev lo table local src 127.0.0.1 uid 0"),
        Some("lo".to_string())
    );
    assert_eq!(
        parse_route_dev("RTNETLINK answers: Network is unreachable"),
        None
    );
    assert_eq!(parse_route_dev("10.0.0.2 dev"), None);
}

#[test]
fn rates_need_a_number_and_a_tc_unit() {
    for ok in [
        "2mbit", "2Mbit", "2MBIT", "1.5mbit", "512kbit", "1gbit", "100bit", "250kbps", "1bps",
        " 2mbit ",
    ] {
        assert!(valid_rate(ok), "{ok:?} should be valid");
    }
    for bad in [
        "", "2", "mbit", "2 mbit", "-2mbit", "0mbit", "2mb", "2MiB", ".5mbit", "5.mbit", "2mbit/s",
        "1e3kbit", "nan", "2kibit",
    ] {
        assert!(!valid_rate(bad), "{bad:?} should be invalid");
    }
    assert_eq!(rate_bits_per_second("2mbit"), Some(2e6));
    assert_eq!(rate_bits_per_second("250kbps"), Some(2e6));
}

#[test]
fn the_default_class_gets_a_tenth_but_at_least_8kbit_and_at_most_the_link() {
    assert_eq!(default_share(2e6), "200000bit");
    assert_eq!(default_share(40_000.0), "8000bit");
    assert_eq!(default_share(5_000.0), "5000bit");
}

#[test]
fn the_high_class_bucket_holds_50ms_of_the_link_and_at_least_two_frames() {
    assert_eq!(high_burst(2e6), "12500b");
    assert_eq!(high_burst(100e6), "625000b");
    assert_eq!(high_burst(64e3), "3200b");
}

#[test]
fn permission_failures_say_that_install_tc_needs_cap_net_admin() {
    let e = classify_failure(
        "tc qdisc replace dev eth0 root handle 1: htb default 20".to_string(),
        "exit status: 2",
        "RTNETLINK answers: Operation not permitted",
    );
    assert!(matches!(e, TcError::NotPermitted { .. }), "{e:?}");
    assert!(e.to_string().contains(
        "install_tc needs CAP_NET_ADMIN (run sluice as root or grant it the capability)"
    ));
    let e = classify_failure(
        "ip netns exec x tc qdisc show".to_string(),
        "exit status: 255",
        "exec of \"tc\" failed: No such file or directory",
    );
    assert_eq!(
        e,
        TcError::NoTcCommand {
            program: "tc".to_string()
        }
    );
    assert!(e.to_string().contains("install iproute2"));
    let e = classify_failure(
        "tc qdisc del dev eth9 root".to_string(),
        "exit status: 1",
        "Cannot find device \"eth9\"",
    );
    assert!(matches!(e, TcError::CommandFailed { .. }), "{e:?}");
    assert!(e.to_string().contains("Cannot find device"));
}

#[test]
fn a_missing_program_is_reported_as_no_tc_command() {
    let e = run("/nonexistent/sluice-no-such-tc", &["-V"]).unwrap_err();
    assert!(matches!(e, TcError::NoTcCommand { .. }), "{e:?}");
}

#[test]
fn cap_net_admin_is_read_from_the_effective_set() {
    assert_eq!(
        has_net_admin("Name:\tx\nCapEff:\t0000000000001000\n"),
        Some(true)
    );
    assert_eq!(has_net_admin("CapEff:\t000001ffffffffff\n"), Some(true));
    assert_eq!(has_net_admin("CapEff:\t0000000000000000\n"), Some(false));
    assert_eq!(has_net_admin("Name:\tx\n"), None);
}

#[test]
fn bad_rates_and_interface_names_are_refused_before_running_anything() {
    let e = TcManager::start(None, "eth0".to_string(), "fast".to_string()).unwrap_err();
    assert!(matches!(e, TcError::InvalidRate { .. }), "{e:?}");
    let e = TcManager::start(None, "a b".to_string(), "2mbit".to_string()).unwrap_err();
    assert!(matches!(e, TcError::InvalidInterface { .. }), "{e:?}");
    let e = TcManager::start(None, "x".repeat(16), "2mbit".to_string()).unwrap_err();
    assert!(matches!(e, TcError::InvalidInterface { .. }), "{e:?}");
}

/// A throw-away network namespace holding a veth pair (`veth0` up, address 10.99.0.1/30,
/// peer `veth1`); deleted on drop, also when the test fails.
struct TestNetns {
    name: String,
}

impl TestNetns {
    fn create() -> TestNetns {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "sluice-tc-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        sh("ip", &["netns", "add", &name]);
        // From here on the namespace exists: the guard deletes it whatever happens next.
        let ns = TestNetns { name };
        let n = ns.name.as_str();
        sh(
            "ip",
            &[
                "-n", n, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1",
            ],
        );
        sh("ip", &["-n", n, "link", "set", "lo", "up"]);
        sh("ip", &["-n", n, "link", "set", "veth0", "up"]);
        sh("ip", &["-n", n, "link", "set", "veth1", "up"]);
        sh(
            "ip",
            &["-n", n, "addr", "add", "10.99.0.1/30", "dev", "veth0"],
        );
        ns
    }

    fn tc(&self, args: &[&str]) -> String {
        let mut argv = vec!["-n", self.name.as_str()];
        argv.extend_from_slice(args);
        sh("tc", &argv)
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn sh(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Filter lines for source port `port` (tc prints the match as hex at offset 20 for IPv4,
/// 40 for IPv6).
fn port_matches(filters: &str, port: u16) -> usize {
    let needle = format!("match {port:04x}0000/ffff0000");
    filters.lines().filter(|l| l.contains(&needle)).count()
}

#[test]
fn installs_htb_classes_and_port_filters_then_removes_them() {
    if !is_root() {
        eprintln!("SKIPPED installs_htb_classes_and_port_filters_then_removes_them: needs root (network namespaces and tc); CI runs it as root");
        return;
    }
    let ns = TestNetns::create();
    let tc = TcManager::start(
        Some(ns.name.clone()),
        "veth0".to_string(),
        "2mbit".to_string(),
    )
    .expect("install the htb tree");

    let qdiscs = ns.tc(&["-s", "qdisc", "show", "dev", "veth0"]);
    assert!(qdiscs.contains("qdisc htb 1: root"), "{qdiscs}");
    assert!(qdiscs.contains("default 0x20"), "{qdiscs}");
    let classes = ns.tc(&["class", "show", "dev", "veth0"]);
    for class in [
        "class htb 1:1 root",
        "class htb 1:10 parent 1:1",
        "class htb 1:20 parent 1:1",
    ] {
        assert!(classes.contains(class), "{class} missing in:\n{classes}");
    }
    assert!(classes.contains("rate 2Mbit ceil 2Mbit"), "{classes}");
    assert!(classes.contains("rate 200Kbit ceil 2Mbit"), "{classes}");
    let high = classes
        .lines()
        .find(|l| l.starts_with("class htb 1:10 "))
        .unwrap_or_default();
    assert!(high.contains("burst 12500b cburst 12500b"), "{high}");

    tc.high_port_up(40000);
    tc.high_port_up(40001);
    tc.high_port_up(40000); // twice: no second filter
    tc.flush().expect("flush");
    let filters = ns.tc(&["filter", "show", "dev", "veth0", "parent", "1:"]);
    assert_eq!(port_matches(&filters, 40000), 2, "v4 + v6:\n{filters}");
    assert_eq!(port_matches(&filters, 40001), 2, "v4 + v6:\n{filters}");
    assert!(filters.contains("flowid 1:10"), "{filters}");

    tc.high_port_down(40000);
    tc.high_port_down(40000); // twice: harmless
    tc.flush().expect("flush");
    let filters = ns.tc(&["filter", "show", "dev", "veth0", "parent", "1:"]);
    assert_eq!(port_matches(&filters, 40000), 0, "{filters}");
    assert_eq!(port_matches(&filters, 40001), 2, "{filters}");

    // A freed slot is reused.
    tc.high_port_up(40002);
    tc.flush().expect("flush");
    let filters = ns.tc(&["filter", "show", "dev", "veth0", "parent", "1:"]);
    assert_eq!(port_matches(&filters, 40002), 2, "{filters}");

    tc.shutdown().expect("remove the root qdisc");
    let qdiscs = ns.tc(&["qdisc", "show", "dev", "veth0"]);
    assert!(!qdiscs.contains("htb"), "{qdiscs}");
    let filters = ns.tc(&["filter", "show", "dev", "veth0", "parent", "1:"]);
    assert_eq!(port_matches(&filters, 40001), 0, "{filters}");
}

#[test]
fn dropping_the_manager_removes_the_tree_and_a_restart_starts_clean() {
    if !is_root() {
        eprintln!("SKIPPED dropping_the_manager_removes_the_tree_and_a_restart_starts_clean: needs root; CI runs it as root");
        return;
    }
    let ns = TestNetns::create();
    {
        let tc = TcManager::start(Some(ns.name.clone()), "veth0".into(), "1mbit".into())
            .expect("install");
        tc.high_port_up(41000);
        tc.flush().expect("flush");
    }
    let qdiscs = ns.tc(&["qdisc", "show", "dev", "veth0"]);
    assert!(!qdiscs.contains("htb"), "drop removes the tree:\n{qdiscs}");

    // A tree left behind (e.g. by a killed process) is replaced, not added to.
    ns.tc(&[
        "qdisc", "replace", "dev", "veth0", "root", "handle", "1:", "htb", "default", "20",
    ]);
    ns.tc(&[
        "filter", "add", "dev", "veth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
        "match", "ip", "sport", "42000", "0xffff", "flowid", "1:10",
    ]);
    let tc = TcManager::start(Some(ns.name.clone()), "veth0".into(), "1mbit".into())
        .expect("install over a leftover tree");
    let filters = ns.tc(&["filter", "show", "dev", "veth0", "parent", "1:"]);
    assert_eq!(
        port_matches(&filters, 42000),
        0,
        "stale filter gone:\n{filters}"
    );
    tc.shutdown().expect("shutdown");
}

#[test]
fn a_missing_interface_is_a_clear_error_and_installs_nothing() {
    if !is_root() {
        eprintln!("SKIPPED a_missing_interface_is_a_clear_error_and_installs_nothing: needs root; CI runs it as root");
        return;
    }
    let ns = TestNetns::create();
    let e = TcManager::start(Some(ns.name.clone()), "nosuch0".into(), "2mbit".into()).unwrap_err();
    assert!(matches!(e, TcError::CommandFailed { .. }), "{e:?}");
    assert!(e.to_string().contains("nosuch0"), "{e}");
}

#[test]
fn route_interface_names_the_veth_towards_its_peer() {
    if !is_root() {
        eprintln!("SKIPPED route_interface_names_the_veth_towards_its_peer: needs root; CI runs it as root");
        return;
    }
    let ns = TestNetns::create();
    let dev = route_interface_in(Some(&ns.name), "10.99.0.2".parse().unwrap()).expect("route");
    assert_eq!(dev, "veth0");
    let dev = route_interface_in(Some(&ns.name), "127.0.0.1".parse().unwrap()).expect("route");
    assert_eq!(dev, "lo");
    // The machine's own routing table answers too (some interface, whatever it is).
    let dev = route_interface("127.0.0.1".parse().unwrap()).expect("route");
    assert_eq!(dev, "lo");
}
