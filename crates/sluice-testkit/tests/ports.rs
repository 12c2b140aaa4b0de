//! Port helpers: a free port can be bound, and `wait_for_port` tells a listening address from
//! a silent one within its timeout.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use sluice_testkit::{free_port, wait_for_port, wait_for_port_blocking};

#[test]
fn free_port_can_be_bound_right_away() {
    let port = free_port().expect("free port");
    assert_ne!(port, 0);
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("port is bindable");
}

#[tokio::test(flavor = "current_thread")]
async fn wait_for_port_returns_once_something_listens() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    wait_for_port(addr, Duration::from_secs(1))
        .await
        .expect("listening port is seen");
    wait_for_port_blocking(addr, Duration::from_secs(1)).expect("blocking variant agrees");
}

#[tokio::test(flavor = "current_thread")]
async fn wait_for_port_gives_up_after_its_timeout_on_a_closed_port() {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port().expect("free port")));
    let start = Instant::now();
    let err = wait_for_port(addr, Duration::from_millis(300))
        .await
        .expect_err("nothing listens");
    assert!(start.elapsed() < Duration::from_secs(2), "gave up promptly");
    assert!(
        err.to_string().contains(&addr.to_string()),
        "error names the address: {err}"
    );
}
