//! A throwaway PostgreSQL cluster for the storage study: `initdb` into a directory under the
//! study's run directory (so on the same file system as the other engines), `pg_ctl start`
//! with a Unix socket in that directory on a free port number and no TCP listener, stopped
//! (`pg_ctl stop -m fast`) when dropped.
//!
//! Binaries: the newest `/usr/lib/postgresql/*/bin` (Debian's `postgresql` package), else
//! `pg_ctl` on `PATH`. `initdb` refuses to run as root, so as root every server command runs
//! as the `postgres` user through `runuser`, and the cluster directory is given to that user.
//! Server settings are PostgreSQL's defaults (`fsync=on`, `synchronous_commit=on`) apart from
//! the socket and listener; authentication is `trust` on the socket only.

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context as _};

/// What the report says when PostgreSQL is missing.
pub const NOT_INSTALLED: &str = "not installed (apt-get install postgresql to include it)";

/// A running cluster.
pub struct Cluster {
    /// `postgres --version`.
    pub version: String,
    bin: PathBuf,
    data: PathBuf,
    socket_dir: PathBuf,
    port: u16,
    run_as: Option<&'static str>,
    stopped: bool,
}

/// The directory holding `pg_ctl`, `initdb` and `postgres`, if installed.
pub fn find_bin_dir() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("pg_ctl").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Some(bin);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).find(|d| d.join("pg_ctl").exists() && d.join("initdb").exists())
}

impl Cluster {
    /// Starts a cluster under `parent`; `Ok(None)` when PostgreSQL is not installed.
    pub fn start(parent: &Path) -> anyhow::Result<Option<Cluster>> {
        let Some(bin) = find_bin_dir() else {
            return Ok(None);
        };
        let root = std::fs::metadata("/proc/self")
            .map(|m| m.uid() == 0)
            .unwrap_or(false);
        let base = parent.join("postgres");
        std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
        let run_as = if root {
            // The server user must reach the cluster directory: open the run directory for
            // traversal and hand the cluster directory over.
            for dir in [parent, &base] {
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
                    .with_context(|| format!("opening {} to the postgres user", dir.display()))?;
            }
            run(
                Command::new("chown")
                    .arg("-R")
                    .arg("postgres:postgres")
                    .arg(&base),
                "chown the cluster directory",
            )?;
            Some("postgres")
        } else {
            None
        };
        let data = base.join("data");
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut cluster = Cluster {
            version: String::new(),
            bin,
            data,
            socket_dir: base.clone(),
            port,
            run_as,
            stopped: true,
        };
        let out = run(
            cluster.command("postgres").arg("--version"),
            "postgres --version",
        )?;
        cluster.version = out.trim().to_string();
        run(
            cluster
                .command("initdb")
                .arg("-D")
                .arg(&cluster.data)
                .args(["-U", "bench", "-A", "trust", "-E", "UTF8", "--no-sync"]),
            "initdb",
        )?;
        let opts = format!(
            "-k {} -p {} -c listen_addresses=''",
            cluster.socket_dir.display(),
            cluster.port
        );
        cluster.stopped = false;
        run(
            cluster
                .command("pg_ctl")
                .arg("-D")
                .arg(&cluster.data)
                .arg("-l")
                .arg(base.join("server.log"))
                .args(["-w", "-t", "60", "-o", &opts, "start"]),
            "pg_ctl start",
        )?;
        Ok(Some(cluster))
    }

    fn command(&self, program: &str) -> Command {
        let exe = self.bin.join(program);
        match self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(exe);
                c
            }
            None => Command::new(exe),
        }
    }

    /// A new client connection over the Unix socket.
    pub fn connect(&self) -> anyhow::Result<postgres::Client> {
        postgres::Config::new()
            .host_path(&self.socket_dir)
            .port(self.port)
            .user("bench")
            .dbname("postgres")
            .connect(postgres::NoTls)
            .context("connecting to the PostgreSQL cluster")
    }

    /// Stops the server (fast shutdown).
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let stop = self
            .command("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "fast", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !stop.is_ok_and(|s| s.success()) {
            eprintln!("storage: pg_ctl stop failed for {}", self.data.display());
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

/// Runs `cmd`, returning its stdout; the error carries its stderr.
fn run(cmd: &mut Command, what: &str) -> anyhow::Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
