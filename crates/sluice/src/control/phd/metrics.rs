//! The PHD metrics: control messages by type, the agent table, configurations learnt and
//! refused, reports and observations (all `sluice_phd_*`).

use crate::telemetry::metrics::{Counter, Gauge, PromWriter};

/// Control messages by type (what a storm is made of).
#[derive(Debug, Default)]
pub struct ControlCounts {
    pub aarq: Counter,
    pub aare: Counter,
    pub config_report: Counter,
    pub config_response: Counter,
    pub rlrq: Counter,
    pub rlre: Counter,
    pub abrt_in: Counter,
    pub abrt_out: Counter,
    pub get: Counter,
    pub get_result: Counter,
    pub other: Counter,
}

#[derive(Debug, Default)]
pub struct PhdMetrics {
    pub control: ControlCounts,
    pub connections: Gauge,
    pub refused_connections: Counter,
    pub agents: Gauge,
    pub agent_table_bytes: Gauge,
    pub agent_strings_truncated: Counter,
    pub configs: Gauge,
    pub associations: Counter,
    pub rejected: Counter,
    pub configs_learnt: Counter,
    pub config_reconfirmed: Counter,
    pub configs_refused: Counter,
    pub config_conflicts: Counter,
    pub agents_not_allowed: Counter,
    pub identity_refused: Counter,
    pub tls_failures: Counter,
    pub handovers: Counter,
    pub reports: Counter,
    pub reports_refused: Counter,
    pub observations: Counter,
    pub measurements: Counter,
    pub observations_skipped: Counter,
    pub reports_unassociated: Counter,
    pub violations: Counter,
    pub timeouts: Counter,
}

impl PhdMetrics {
    pub fn render(&self, w: &mut PromWriter) {
        let c = &self.control;
        for (kind, dir, v) in [
            ("aarq", "in", &c.aarq),
            ("aare", "out", &c.aare),
            ("config_report", "in", &c.config_report),
            ("config_response", "out", &c.config_response),
            ("rlrq", "in", &c.rlrq),
            ("rlre", "out", &c.rlre),
            ("abrt", "in", &c.abrt_in),
            ("abrt", "out", &c.abrt_out),
            ("get", "out", &c.get),
            ("get_result", "in", &c.get_result),
            ("other", "in", &c.other),
        ] {
            w.counter(
                "sluice_phd_control_messages_total",
                "PHD signalling APDUs (association, configuration, release, abort, MDS GET) by type and direction",
                &[("type", kind), ("direction", dir)],
                v.get(),
            );
        }
        w.gauge(
            "sluice_phd_connections",
            "PHD agent connections open",
            &[],
            self.connections.get(),
        );
        w.counter(
            "sluice_phd_refused_connections_total",
            "PHD connections closed at accept (phd.max_connections)",
            &[],
            self.refused_connections.get(),
        );
        w.gauge(
            "sluice_phd_agents",
            "PHD agents in the agent table (associated or associating)",
            &[],
            self.agents.get(),
        );
        w.gauge(
            "sluice_phd_agent_table_bytes",
            "Bytes the PHD agent table holds (entries and their strings; at most max_agents x the per-agent bound)",
            &[],
            self.agent_table_bytes.get(),
        );
        w.counter(
            "sluice_phd_agent_strings_truncated_total",
            "Agent strings (MDS model) cut to 64 bytes before being kept",
            &[],
            self.agent_strings_truncated.get(),
        );
        w.gauge(
            "sluice_phd_configs",
            "Extended configurations remembered",
            &[],
            self.configs.get(),
        );
        for (name, help, v) in [
            ("sluice_phd_associations_total", "Associations accepted (known configuration or after configuring)", &self.associations),
            ("sluice_phd_rejected_total", "Association requests rejected", &self.rejected),
            ("sluice_phd_configs_learnt_total", "Configuration reports accepted and stored (a new table)", &self.configs_learnt),
            ("sluice_phd_config_reconfirmed_total", "Configuration reports identical to the stored table, sent by an agent asked again (from another address than its teacher's): accepted, the teacher stays", &self.config_reconfirmed),
            ("sluice_phd_configs_refused_total", "Configuration reports answered unsupported-config", &self.configs_refused),
            ("sluice_phd_config_conflicts_total", "Configuration reports refused (then aborted): another table for a system id and config id another agent taught first", &self.config_conflicts),
            ("sluice_phd_agents_not_allowed_total", "Association requests rejected-unauthorized: system id not in [phd] agents", &self.agents_not_allowed),
            ("sluice_phd_identity_refused_total", "Association requests rejected-unauthorized: the system id's configurations were taught by another certificate identity (or none)", &self.identity_refused),
            ("sluice_phd_tls_failures_total", "PHD connections closed in the TLS handshake (bad or missing client certificate, not TLS, timeout)", &self.tls_failures),
            ("sluice_phd_handovers_total", "Operating agents handed from the control plane to their shard", &self.handovers),
            ("sluice_phd_reports_total", "Scan reports decoded on the shards", &self.reports),
            ("sluice_phd_reports_refused_total", "Confirmed reports answered ROER instead of confirmed: an uplink refused their data for good", &self.reports_refused),
            ("sluice_phd_observations_total", "Observations decoded", &self.observations),
            ("sluice_phd_measurements_total", "Measurements published (one SenML message each)", &self.measurements),
            ("sluice_phd_observations_skipped_total", "Observations dropped: unknown handle, length not matching the value map, special value", &self.observations_skipped),
            ("sluice_phd_reports_unassociated_total", "Reports from agents not associated (answered ABRT or ROER)", &self.reports_unassociated),
            ("sluice_phd_violations_total", "Protocol violations (malformed APDUs, APDUs not allowed in the state)", &self.violations),
            ("sluice_phd_timeouts_total", "Association, configuration or response timeouts", &self.timeouts),
        ] {
            w.counter(name, help, &[], v.get());
        }
    }
}
