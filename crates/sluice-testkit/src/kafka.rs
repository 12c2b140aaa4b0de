//! A real Apache Kafka cluster for the Kafka tests and `sluice-bench scenario kafka`: three
//! KRaft nodes of Kafka 4.4.0 started by the repository's `scripts/kafka-cluster` (jars from the
//! Maven repository, Java 17+), stopped when dropped. [`KafkaCluster::start`] gives `None`
//! (with a printed SKIP) only where Java or Maven is missing.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context as _;

/// `scripts/kafka-cluster` of this checkout.
pub fn default_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/kafka-cluster")
}

/// A running cluster, stopped when dropped.
pub struct KafkaCluster {
    script: PathBuf,
    pub dir: tempfile::TempDir,
    /// `host:port,…` of the PLAINTEXT listeners.
    pub bootstrap: String,
}

impl KafkaCluster {
    /// Three nodes; `scram`: also SASL_PLAINTEXT listeners with `user:password` stored.
    pub fn start(scram: Option<&str>) -> Option<KafkaCluster> {
        Self::start_with(scram, None)
    }

    /// [`KafkaCluster::start`], and with `tls` (certificate chain, key: PEM files) also TLS
    /// listeners.
    pub fn start_with(
        scram: Option<&str>,
        tls: Option<(&std::path::Path, &std::path::Path)>,
    ) -> Option<KafkaCluster> {
        for tool in ["java", "mvn"] {
            if Command::new(tool).arg("-version").output().is_err() {
                eprintln!("SKIP: `{tool}` not found (scripts/test installs it); no Kafka cluster");
                return None;
            }
        }
        Some(
            Self::launch(&default_script(), scram, tls)
                .unwrap_or_else(|e| panic!("kafka-cluster start failed: {e:#}")),
        )
    }

    /// Start three nodes with `script`; an error says why.
    pub fn launch(
        script: &Path,
        scram: Option<&str>,
        tls: Option<(&Path, &Path)>,
    ) -> anyhow::Result<KafkaCluster> {
        let dir = tempfile::Builder::new().prefix("sluice-kafka-").tempdir()?;
        // A base port per process (and per call), so parallel tests do not collide; below the
        // kernel's ephemeral ports (32768 and up), so no outgoing connection holds one.
        static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let base = 20_000 + ((std::process::id() * 7 + call * 13) % 110) * 100;
        let mut cmd = Command::new(script);
        cmd.args([
            "start",
            &dir.path().to_string_lossy(),
            "3",
            &base.to_string(),
        ]);
        if let Some(s) = scram {
            cmd.env("KAFKA_SCRAM", s);
        }
        if let Some((cert, key)) = tls {
            cmd.env("KAFKA_TLS", format!("{}:{}", cert.display(), key.display()));
        }
        let out = cmd
            .output()
            .with_context(|| format!("running {}", script.display()))?;
        if !out.status.success() {
            anyhow::bail!(
                "{} start: {}",
                script.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let bootstrap = String::from_utf8(out.stdout)?.trim().to_string();
        Ok(KafkaCluster {
            script: script.to_path_buf(),
            dir,
            bootstrap,
        })
    }

    /// The SASL_PLAINTEXT bootstrap list (after `start(Some(..))`).
    pub fn sasl_bootstrap(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("bootstrap-sasl"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// The TLS bootstrap list (after `start_with(_, Some(..))`).
    pub fn tls_bootstrap(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("bootstrap-tls"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// Run one of Kafka's own tools; its standard output.
    pub fn tool(&self, args: &[&str]) -> String {
        let out = Command::new(&self.script)
            .arg("tool")
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Create `topic` with `partitions`, replication factor 3.
    pub fn create_topic(&self, topic: &str, partitions: u32) {
        let out = self.tool(&[
            "org.apache.kafka.tools.TopicCommand",
            "--bootstrap-server",
            &self.bootstrap,
            "--create",
            "--topic",
            topic,
            "--partitions",
            &partitions.to_string(),
            "--replication-factor",
            "3",
        ]);
        assert!(out.contains("Created topic"), "create {topic}: {out}");
    }

    /// The node id leading partition `partition` of `topic`.
    pub fn leader(&self, topic: &str, partition: u32) -> u32 {
        let out = self.tool(&[
            "org.apache.kafka.tools.TopicCommand",
            "--bootstrap-server",
            &self.bootstrap,
            "--describe",
            "--topic",
            topic,
        ]);
        for line in out.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let get = |k: &str| {
                fields
                    .iter()
                    .position(|f| *f == k)
                    .and_then(|i| fields.get(i + 1))
                    .copied()
            };
            if get("Partition:") == Some(&partition.to_string()) {
                if let Some(l) = get("Leader:").and_then(|l| l.parse().ok()) {
                    return l;
                }
            }
        }
        panic!("no leader for {topic}/{partition} in {out}");
    }

    /// SIGKILL node `node` (1-based, as `scripts/kafka-cluster` numbers them).
    pub fn kill(&self, node: u32) {
        let status = Command::new(&self.script)
            .args(["kill", self.dir.path().to_str().unwrap(), &node.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Send `signal` (e.g. `"STOP"`, `"CONT"`) to every node's JVM.
    fn signal_all(&self, signal: &str) {
        for entry in std::fs::read_dir(self.dir.path()).unwrap().flatten() {
            let pid = entry.path().join("pid");
            if let Ok(pid) = std::fs::read_to_string(&pid) {
                let _ = Command::new("kill")
                    .args([&format!("-{signal}"), pid.trim()])
                    .status();
            }
        }
    }

    /// Freeze every node (SIGSTOP): the cluster accepts connections but answers nothing, as
    /// an overloaded or unreachable cloud does. Undo with [`KafkaCluster::resume`] within
    /// Kafka's session timeout (9 s) to keep the leaders where they are.
    pub fn pause(&self) {
        self.signal_all("STOP");
    }

    /// Thaw every node after [`KafkaCluster::pause`] (SIGCONT).
    pub fn resume(&self) {
        self.signal_all("CONT");
    }

    /// Every record of `topic` from the start: `(headers, key, value)` per line, as Kafka's
    /// console consumer prints them, stopping after `max` or 20 s without a record.
    pub fn consume(&self, topic: &str, max: usize) -> Vec<(String, String, String)> {
        let out = self.tool(&[
            "org.apache.kafka.tools.consumer.ConsoleConsumer",
            "--bootstrap-server",
            &self.bootstrap,
            "--topic",
            topic,
            "--from-beginning",
            "--max-messages",
            &max.to_string(),
            "--timeout-ms",
            "20000",
            "--formatter-property",
            "print.key=true",
            "--formatter-property",
            "print.headers=true",
            "--formatter-property",
            "key.separator=|",
            "--formatter-property",
            "headers.separator=;",
        ]);
        out.lines()
            .filter_map(|l| {
                let mut p = l.splitn(3, '|');
                Some((
                    p.next()?.to_string(),
                    p.next()?.to_string(),
                    p.next()?.to_string(),
                ))
            })
            .collect()
    }
}

impl Drop for KafkaCluster {
    fn drop(&mut self) {
        // A paused node would ignore the SIGTERM below until its SIGKILL.
        self.resume();
        let _ = Command::new(&self.script)
            .args(["stop", self.dir.path().to_str().unwrap()])
            .status();
    }
}
