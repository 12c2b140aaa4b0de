//! sluice's admin `/metrics` endpoint polled during a run, and a sum over a metric's series.

use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::timeout;

use crate::harness::procfs::round3;
use crate::payload::unix_now_ns;

pub(crate) struct MetricsPoller {
    pub(crate) stop: watch::Sender<bool>,
    pub(crate) task: tokio::task::JoinHandle<Vec<MetricsSample>>,
}

impl MetricsPoller {
    pub(crate) fn start(admin_port: u16, started_ns: u64) -> MetricsPoller {
        let (stop, mut stop_rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(METRICS_EVERY);
            loop {
                tokio::select! {
                    _ = stop_rx.changed() => return samples,
                    _ = tick.tick() => {}
                }
                let t_s = ns_to_s(started_ns, unix_now_ns());
                if let Ok(Ok(text)) =
                    timeout(Duration::from_secs(2), http_get(admin_port, "/metrics")).await
                {
                    samples.push(MetricsSample {
                        t_s,
                        backlog_records: metric_sum(&text, "sluice_spool_backlog_records"),
                        unacked_records: metric_sum(&text, "sluice_spool_unacked_records"),
                        bytes: metric_sum(&text, "sluice_spool_bytes"),
                        appended: metric_sum(&text, "sluice_spool_records_appended_total"),
                        acked: metric_sum(&text, "sluice_spool_records_acked_total"),
                    });
                }
            }
        });
        MetricsPoller { stop, task }
    }

    pub(crate) async fn stop(self) -> Vec<MetricsSample> {
        let _ = self.stop.send(true);
        self.task.await.unwrap_or_default()
    }
}

pub(crate) async fn http_get(port: u16, path: &str) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    let mut body = Vec::new();
    s.read_to_end(&mut body).await?;
    let text = String::from_utf8_lossy(&body).into_owned();
    Ok(text
        .split_once("\r\n\r\n")
        .map_or(text.clone(), |(_, b)| b.to_string()))
}

/// The sum of every sample of `name` (any labels) in a Prometheus text exposition; `None` when
/// there is none.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        if let Some(v) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            sum = Some(sum.unwrap_or(0.0) + v);
        }
    }
    sum
}

/// How often sluice's `/metrics` is read.
pub(crate) const METRICS_EVERY: Duration = Duration::from_millis(500);

/// One sample of sluice's spool metrics.
#[derive(Debug, Clone, Serialize)]
pub struct MetricsSample {
    pub t_s: f64,
    pub backlog_records: Option<f64>,
    pub unacked_records: Option<f64>,
    pub bytes: Option<f64>,
    pub appended: Option<f64>,
    pub acked: Option<f64>,
}

pub(crate) fn ns_to_s(started_ns: u64, ns: u64) -> f64 {
    round3((ns as f64 - started_ns as f64) / 1e9)
}
