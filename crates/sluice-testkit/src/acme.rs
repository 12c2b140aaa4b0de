//! A real ACME oneM2M CSE (PyPI `acmecse`) as a child process, for tests and benchmarks of the
//! oneM2M uplink.
//!
//! Owns: one `acmecse --headless --config acme.ini` process (onem2m-http.md §8) on a free
//! loopback port, its generated `acme.ini` and temporary base directory, stopping it (SIGTERM,
//! then SIGKILL) and restarting it on the same port, and a few lines of raw HTTP/1.1 to
//! retrieve resources (`X-M2M-Origin: CAdmin`, full access). Does not own: sluice's client.
//!
//! The CSE is an IN-CSE `id-in` / `cse-in` with an in-memory database (so a restart forgets
//! every resource, as a crash would), logging at warning level, web UI and statistics off, and
//! by default served by waitress (`[http.wsgi] enable=true`: keep-alive and pipelining; ACME's
//! default Werkzeug server closes the connection after every response —
//! [`AcmeBuilder::werkzeug`] runs that one instead).
//!
//! Stopping sends SIGINT ([`Acme::stop`] says why not SIGTERM).
//!
//! Invariants: the process never outlives its [`Acme`] handle (Drop kills and reaps it); the
//! port is fixed at the first start and reused by [`Acme::restart`]. Starting blocks for up
//! to [`START_TIMEOUT`] while polling `GET /cse-in`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use tempfile::TempDir;

use crate::ports::free_port;

/// How long a start waits for the CSE to answer.
pub const START_TIMEOUT: Duration = Duration::from_secs(40);
/// Environment variable that overrides the `acmecse` command.
pub const ACME_BIN_ENV: &str = "SLUICE_ACMECSE";

/// Options for an [`Acme`].
#[derive(Debug, Clone, Default)]
pub struct AcmeBuilder {
    werkzeug: bool,
    persistent: bool,
    extra: String,
}

impl AcmeBuilder {
    /// Serve with ACME's default Werkzeug server (one request per connection).
    pub fn werkzeug(mut self) -> Self {
        self.werkzeug = true;
        self
    }

    /// Keep resources across restarts (TinyDB files in the base directory) instead of the
    /// in-memory database.
    pub fn persistent(mut self) -> Self {
        self.persistent = true;
        self
    }

    /// Extra `acme.ini` text, appended verbatim (sections of their own).
    pub fn extra_ini(mut self, text: &str) -> Self {
        self.extra.push_str(text);
        self
    }

    pub fn start(self) -> anyhow::Result<Acme> {
        let dir = tempfile::tempdir().context("temp dir for ACME")?;
        let port = free_port()?;
        let mut acme = Acme {
            dir,
            port,
            child: None,
        };
        std::fs::write(acme.dir.path().join("acme.ini"), self.ini(port))
            .context("write acme.ini")?;
        acme.launch()?;
        Ok(acme)
    }

    fn ini(&self, port: u16) -> String {
        let wsgi = if self.werkzeug { "false" } else { "true" };
        let db = if self.persistent { "tinydb" } else { "memory" };
        // TinyDB writes are delayed by a second by default, and a stop can lose them: a
        // "persistent" CSE that forgets answered creates would test ACME, not sluice.
        let tinydb = if self.persistent {
            "[database.tinydb]\nwriteDelay=0\n"
        } else {
            ""
        };
        format!(
            "[basic.config]\ncseType=IN\ncseID=id-in\ncseName=cse-in\nadminID=CAdmin\nnetworkInterface=127.0.0.1\ncseHost=127.0.0.1\nhttpPort={port}\ndatabaseType={db}\nlogLevel=warning\nconsoleTheme=dark\nconsoleType=simple\n\n[console]\nheadless=true\n\n[textui]\nstartWithTUI=false\n\n[webui]\nenable=false\n\n[cse.statistics]\nenable=false\n\n[http.wsgi]\nenable={wsgi}\nthreadPoolSize=16\nconnectionLimit=200\n\n{tinydb}\n{}\n",
            self.extra
        )
    }
}

/// A running ACME CSE (see the module docs).
pub struct Acme {
    dir: TempDir,
    port: u16,
    child: Option<Child>,
}

/// A retrieved resource.
#[derive(Debug, Clone)]
pub struct AcmeResponse {
    pub status: u16,
    /// `X-M2M-RSC`.
    pub rsc: Option<u32>,
    pub body: String,
}

impl AcmeResponse {
    /// The body as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

impl Acme {
    pub fn builder() -> AcmeBuilder {
        AcmeBuilder::default()
    }

    /// An ACME with the defaults (waitress, in-memory database).
    pub fn start() -> anyhow::Result<Acme> {
        AcmeBuilder::default().start()
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The base directory (its `acme.ini`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn launch(&mut self) -> anyhow::Result<()> {
        let bin = std::env::var(ACME_BIN_ENV).unwrap_or_else(|_| "acmecse".into());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("acme.out"))
            .context("ACME log file")?;
        let child = Command::new(&bin)
            .args(["--headless", "--config", "acme.ini", "--base-directory"])
            .arg(self.dir.path())
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {bin} (pip install acmecse; or set {ACME_BIN_ENV})"))?;
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(r) = self.get("/cse-in", "CAdmin") {
                if r.rsc == Some(2000) {
                    return Ok(());
                }
            }
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    bail!(
                        "ACME exited with {status} before answering:\n{}",
                        self.log_tail()
                    );
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "ACME did not answer on {} within {START_TIMEOUT:?}:\n{}",
                    self.addr(),
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The last lines of ACME's output.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("acme.out")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Stop the CSE (SIGINT, SIGKILL after 5 s); its in-memory resources are gone. SIGINT, not
    /// SIGTERM: with TinyDB, ACME 2026.5.3 stopped by SIGTERM lost the last contentInstances
    /// it had answered 2001 (98 of 100 kept, even with `writeDelay=0`); stopped by SIGINT it
    /// kept all of them.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(pid) = i32::try_from(child.id()) {
            // SAFETY: kill(2) on our own child's pid (not yet reaped, so not reused) has no
            // memory effects; a failure only means it already exited.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(pid, libc::SIGINT);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Stop and start again on the same port (an empty CSE).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.launch()
    }

    /// `GET {path}` as `origin` (one request on its own connection).
    pub fn get(&self, path: &str, origin: &str) -> anyhow::Result<AcmeResponse> {
        self.request("GET", path, origin)
    }

    /// `DELETE {path}` as `CAdmin` (e.g. to make the CSE lose a container).
    pub fn delete(&self, path: &str) -> anyhow::Result<AcmeResponse> {
        self.request("DELETE", path, "CAdmin")
    }

    fn request(&self, method: &str, path: &str, origin: &str) -> anyhow::Result<AcmeResponse> {
        let mut s = TcpStream::connect_timeout(&self.addr(), Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nX-M2M-Origin: {origin}\r\nX-M2M-RI: testkit\r\nX-M2M-RVI: 3\r\nAccept: application/json\r\nConnection: close\r\n\r\n",
            self.addr()
        )?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").context("no end of head")?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .context("no status")?;
        let rsc = head.lines().find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.trim()
                .eq_ignore_ascii_case("x-m2m-rsc")
                .then(|| value.trim().parse().ok())?
        });
        Ok(AcmeResponse {
            status,
            rsc,
            body: body.to_string(),
        })
    }

    /// The `rn` paths of every resource of type `ty` under `path` (discovery, `fu=1`).
    pub fn discover(&self, path: &str, ty: u8) -> anyhow::Result<Vec<String>> {
        let r = self.get(&format!("{path}?fu=1&ty={ty}"), "CAdmin")?;
        Ok(r.json()["m2m:uril"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// The contentInstances of container `path`, oldest first (`rcn=4`: the container with
    /// its children), as their `(cnf, con)`.
    pub fn content_instances(&self, path: &str) -> anyhow::Result<Vec<(String, String)>> {
        let r = self.get(&format!("{path}?rcn=4"), "CAdmin")?;
        if r.rsc != Some(2000) {
            bail!("GET {path}: HTTP {} RSC {:?}: {}", r.status, r.rsc, r.body);
        }
        let v = r.json();
        let mut out: Vec<(String, String, String)> = v["m2m:cnt"]["m2m:cin"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|c| {
                        (
                            c["ct"].as_str().unwrap_or_default().to_string(),
                            c["cnf"].as_str().unwrap_or_default().to_string(),
                            c["con"].as_str().unwrap_or_default().to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out.into_iter().map(|(_, cnf, con)| (cnf, con)).collect())
    }
}

impl Drop for Acme {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
