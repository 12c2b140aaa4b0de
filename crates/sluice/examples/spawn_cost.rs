//! Cold-start spawn cost, three ways in one run (ADR 0004's addendum, issue 29):
//!
//! - `clone-vfork`: sluice's own spawner (`functions::runtime::process`: `clone(CLONE_VM |
//!   CLONE_VFORK)`, fd 3, `LISTEN_PID`, `PR_SET_PDEATHSIG`, own process group).
//! - `command-pre_exec`: `std::process::Command` doing what the fd-3 path needs that `Command`
//!   cannot express (fd 3 via `dup2`, `PR_SET_PDEATHSIG`) in a `pre_exec` closure — which
//!   makes std `fork` the parent. `LISTEN_PID` is *not* set (it cannot be, without a shell
//!   wrapper or sluice's arena): a lower bound of that path's cost.
//! - `command-posix_spawn`: `Command` with env, working directory, stdin `/dev/null` and
//!   `process_group(0)` only — std uses `posix_spawn` (glibc: `clone(CLONE_VM|CLONE_VFORK)`).
//!   No fd 3, no `PR_SET_PDEATHSIG`: enough for `socket = "port"` only.
//!
//! The parent first touches `--rss-mib` MiB (a gateway with buffers and tables), and one
//! "shard" thread keeps writing one byte per page over that memory the whole time: it stands
//! for the shards that work while an instance starts. Per way: `--spawns` spawns of `/bin/true`
//! (5 ms apart, each reaped before the next), the parent's time in the spawn call, the
//! process's minor page faults per spawn, and the shard thread's page writes per second and
//! longest gap between two of its checkpoints (every 256 pages), against a phase with no
//! spawns.
//!
//! `cargo run -p sluice --example spawn_cost -- [--rss-mib 256] [--spawns 200] [--writer 0]`
//! (`--writer 0`: no writing thread, the spawn alone).
#![allow(unsafe_code)]

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice::config::FunctionConfig;
use sluice::functions::runtime::process::{self, Plan};

const PAGE: usize = 4096;

struct Shard {
    writes: AtomicU64,
    max_gap_ns: AtomicU64,
    stop: AtomicBool,
}

fn minflt() -> i64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    ru.ru_minflt
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

fn main() {
    let mut rss_mib = 256usize;
    let mut spawns = 200usize;
    let mut with_writer = true;
    let args: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--rss-mib" => rss_mib = args[i + 1].parse().expect("MiB"),
            "--spawns" => spawns = args[i + 1].parse().expect("count"),
            "--writer" => with_writer = args[i + 1] != "0",
            a => panic!("unknown argument {a}"),
        }
        i += 2;
    }
    let len = rss_mib << 20;
    let mut region = vec![0u8; len];
    for p in (0..len).step_by(PAGE) {
        region[p] = 1; // touched: mapped, in the page tables
    }
    let base = region.as_mut_ptr() as usize;
    let shard = Arc::new(Shard {
        writes: AtomicU64::new(0),
        max_gap_ns: AtomicU64::new(0),
        stop: AtomicBool::new(false),
    });
    let sh = shard.clone();
    let writer = std::thread::spawn(move || {
        let mut at = 0usize;
        let mut last = Instant::now();
        let mut n = 0u64;
        while with_writer && !sh.stop.load(Ordering::Relaxed) {
            for _ in 0..256 {
                // SAFETY (bench): `base..base+len` is the live Vec owned by main, which joins
                // this thread before dropping it.
                unsafe { std::ptr::write_volatile((base + at) as *mut u8, n as u8) };
                at = (at + PAGE) % len;
                n += 1;
            }
            let now = Instant::now();
            let gap = now.duration_since(last).as_nanos() as u64;
            last = now;
            sh.max_gap_ns.fetch_max(gap, Ordering::Relaxed);
            sh.writes.fetch_add(256, Ordering::Relaxed);
        }
    });

    let cfg: FunctionConfig =
        toml::from_str("name = \"bench\"\ntopics = [\"#\"]\ncommand = [\"/bin/true\"]\n")
            .expect("config");
    let devnull = || Stdio::null();
    println!(
        "spawn_cost: rss {rss_mib} MiB touched, {spawns} spawns of /bin/true per way, {} writer thread; {} build",
        if with_writer { "one" } else { "no" },
        if cfg!(debug_assertions) { "debug" } else { "release" }
    );
    println!(
        "{:<22} {:>9} {:>9} {:>9} {:>11} {:>13} {:>12}",
        "way", "p50 µs", "p99 µs", "max µs", "minflt/sp", "writes/s (M)", "max gap µs"
    );
    let phase = |name: &str, spawn: &mut dyn FnMut() -> Option<Duration>| {
        std::thread::sleep(Duration::from_millis(200));
        shard.max_gap_ns.store(0, Ordering::Relaxed);
        let w0 = shard.writes.load(Ordering::Relaxed);
        let f0 = minflt();
        let t0 = Instant::now();
        let mut took = Vec::new();
        for _ in 0..spawns {
            if let Some(d) = spawn() {
                took.push(d.as_secs_f64() * 1e6);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let secs = t0.elapsed().as_secs_f64();
        let writes = shard.writes.load(Ordering::Relaxed) - w0;
        let faults = minflt() - f0;
        let gap = shard.max_gap_ns.load(Ordering::Relaxed) as f64 / 1e3;
        if took.is_empty() {
            println!(
                "{name:<22} {:>9} {:>9} {:>9} {:>11} {:>13.1} {:>12.0}",
                "-",
                "-",
                "-",
                "-",
                writes as f64 / secs / 1e6,
                gap
            );
        } else {
            let max = took.iter().cloned().fold(0.0, f64::max);
            println!(
                "{name:<22} {:>9.0} {:>9.0} {:>9.0} {:>11.0} {:>13.1} {:>12.0}",
                pct(&mut took, 0.5),
                pct(&mut took, 0.99),
                max,
                faults as f64 / spawns as f64,
                writes as f64 / secs / 1e6,
                gap
            );
        }
    };

    phase("no spawn (baseline)", &mut || None);

    phase("clone-vfork (sluice)", &mut || {
        let prepared = process::prepare(&cfg, Plan::Inherit).expect("prepare");
        let t = Instant::now();
        let sp = prepared.spawn().expect("spawn");
        let d = t.elapsed();
        let mut child = sp.child;
        while child.try_wait().expect("wait").is_none() {
            std::thread::sleep(Duration::from_micros(200));
        }
        Some(d)
    });

    phase("command-pre_exec (fork)", &mut || {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let fd = listener.as_raw_fd();
        let port = listener.local_addr().expect("addr").port();
        let mut cmd = Command::new("/bin/true");
        cmd.env("PORT", port.to_string())
            .env("LISTEN_FDS", "1")
            .env("LISTEN_FDNAMES", "http")
            .stdin(devnull())
            .process_group(0);
        // SAFETY (bench): only async-signal-safe calls in the child.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) != 0
                    || libc::dup2(fd, 3) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let t = Instant::now();
        let mut child = cmd.spawn().expect("spawn");
        let d = t.elapsed();
        child.wait().expect("wait");
        Some(d)
    });

    phase("command-posix_spawn", &mut || {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port")
            .port();
        let mut cmd = Command::new("/bin/true");
        cmd.env("PORT", port.to_string())
            .current_dir("/")
            .stdin(devnull())
            .process_group(0);
        let t = Instant::now();
        let mut child = cmd.spawn().expect("spawn");
        let d = t.elapsed();
        child.wait().expect("wait");
        Some(d)
    });

    phase("no spawn (again)", &mut || None);

    shard.stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer");
    drop(region);
}
