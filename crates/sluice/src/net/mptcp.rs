//! MPTCP state of a connected socket (MPTCP_INFO / MPTCP_FULL_INFO, TCP_IS_MPTCP) and its
//! metrics. SKELETON: filled in by issue 17's MPTCP work.

/// MPTCP status of one uplink session, for `/api/v1/status` and `/metrics`.
#[derive(Debug, Default)]
pub struct MptcpMetrics {}

impl MptcpMetrics {
    /// A connection of this session was established: `asked` whether MPTCP was configured,
    /// `mptcp_socket` whether the socket is an MPTCP one (the kernel took IPPROTO_MPTCP).
    pub fn on_connect<S: std::os::fd::AsFd>(&self, _socket: &S, _asked: bool, _mptcp_socket: bool) {
    }

    /// The session's connection ended.
    pub fn on_close(&self) {}

    /// The status JSON (`null` while MPTCP was never asked for).
    pub fn status(&self) -> serde_json::Value {
        serde_json::Value::Null
    }

    pub fn render(&self, _w: &mut crate::telemetry::metrics::PromWriter, _labels: &[(&str, &str)]) {
    }
}
