//! The disk cases: the spool on a small tmpfs that is filled to the last byte and freed, or on
//! ext4 on a loop device that an error remounts read-only (`errors=remount-ro` and the
//! kernel's `/sys/fs/ext4/<dev>/trigger_fs_error`, as a failing SD card does) and that is
//! remounted read-write afterwards. Owns the mounts (unmounted, loop device detached, on drop)
//! and the case's timeline; root needed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context as _};
use tokio::time::Instant;

use super::super::bed::Bed;
use super::super::load::Load;
use super::super::pause;
use super::Outcome;
use crate::harness::metrics::metric_sum;

/// A mounted file system for the spool; dropping it unmounts it.
pub struct Mount {
    /// A bind mount of itself, made shared, under which `dir` is mounted: an unmount of `dir`
    /// then reaches the copies that `ip netns exec` (the cloud broker's launcher) made of the
    /// mount table, so the file system can really be unmounted and repaired.
    base: PathBuf,
    pub dir: PathBuf,
    loop_dev: Option<String>,
}

fn run(argv: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .with_context(|| format!("running {}", argv.join(" ")))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            argv.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn shared_base(base: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(base).context("the mount base")?;
    let b = base.display().to_string();
    run(&["mount", "--bind", &b, &b])?;
    run(&["mount", "--make-shared", &b])?;
    let dir = base.join("fs");
    std::fs::create_dir_all(&dir).context("the mount point")?;
    Ok(dir)
}

impl Mount {
    /// A tmpfs of `size` (e.g. "32m") at `base/fs`.
    pub fn tmpfs(base: &Path, size: &str) -> anyhow::Result<Mount> {
        let dir = shared_base(base)?;
        let d = dir.display().to_string();
        if let Err(e) = run(&[
            "mount",
            "-t",
            "tmpfs",
            "-o",
            &format!("size={size}"),
            "tmpfs",
            &d,
        ]) {
            let _ = run(&["umount", "-l", &base.display().to_string()]);
            return Err(e);
        }
        Ok(Mount {
            base: base.to_path_buf(),
            dir,
            loop_dev: None,
        })
    }

    /// ext4 (`errors=remount-ro`) on a loop device over a `mib` MiB image in `work`.
    pub fn ext4_loop(base: &Path, work: &Path, mib: u64) -> anyhow::Result<Mount> {
        let dir = shared_base(base)?;
        let img = work.join("spool.img");
        let f = std::fs::File::create(&img).context("the image file")?;
        f.set_len(mib << 20).context("sizing the image")?;
        drop(f);
        let img_s = img.display().to_string();
        run(&["mkfs.ext4", "-q", "-F", &img_s])?;
        let dev = run(&["losetup", "-f", "--show", &img_s])?;
        let d = dir.display().to_string();
        if let Err(e) = run(&["mount", "-o", "errors=remount-ro", &dev, &d]) {
            let _ = run(&["losetup", "-d", &dev]);
            let _ = run(&["umount", "-l", &base.display().to_string()]);
            return Err(e);
        }
        Ok(Mount {
            base: base.to_path_buf(),
            dir,
            loop_dev: Some(dev),
        })
    }

    /// The loop device's file system unmounted, checked (`e2fsck -fy`) and mounted again: what
    /// an operator does when the kernel keeps a failed ext4 read-only until it is unmounted.
    fn repair(&self) -> anyhow::Result<String> {
        let d = self.dir.display().to_string();
        let dev = self.loop_dev.clone().context("no loop device")?;
        run(&["umount", &d])?;
        let fsck = Command::new("e2fsck")
            .args(["-fy", &dev])
            .output()
            .context("running e2fsck")?;
        run(&["mount", "-o", "errors=remount-ro", &dev, &d])?;
        Ok(format!("e2fsck exit {}", fsck.status.code().unwrap_or(-1)))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let d = self.dir.display().to_string();
        let _ = run(&["umount", "-l", &d]);
        let _ = run(&["umount", "-l", &self.base.display().to_string()]);
        if let Some(dev) = &self.loop_dev {
            let _ = run(&["losetup", "-d", dev]);
        }
    }
}

/// Fill the file system at `dir` with `fill` until a write fails; bytes written.
fn fill_up(fill: &Path) -> u64 {
    use std::io::Write as _;
    let Ok(mut f) = std::fs::File::create(fill) else {
        return 0;
    };
    let chunk = vec![0u8; 64 * 1024];
    let mut written = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => written += n as u64,
        }
    }
    let _ = f.sync_all();
    // Small leftovers (a few pages) are taken too.
    loop {
        match f.write(&chunk[..4096]) {
            Ok(0) | Err(_) => break,
            Ok(n) => written += n as u64,
        }
    }
    written
}

/// Acknowledgements made during `d`.
async fn acks_during(load: &Load, d: Duration) -> u64 {
    let a = load.acked_now();
    pause(d).await;
    load.acked_now() - a
}

pub(crate) async fn disk_fault(
    name: &str,
    bed: &mut Bed,
    load: &mut Load,
    mount: Option<&Mount>,
    o: &mut Outcome,
) -> anyhow::Result<()> {
    let mount = mount.context("the case has no spool mount")?;
    let pid = bed.sluice.pid();
    let hold = Duration::from_secs(10);
    let before = acks_during(load, Duration::from_secs(2)).await;
    // The cloud goes away first, so the spool holds a backlog when the disk fails (issue 31's
    // report: acknowledged messages wedged behind a recovery that needs free space).
    bed.net.cut(0).map_err(anyhow::Error::msg)?;
    pause(Duration::from_secs(3)).await;
    let m0 = bed.metrics().await;
    let backlog = metric_sum(&m0, "sluice_spool_unacked_records").unwrap_or(0.0);
    let fill = mount.dir.join("filler");
    let what = if name == "disk-full" {
        let n = tokio::task::block_in_place(|| fill_up(&fill));
        format!(
            "filled the 32 MiB tmpfs with {:.1} MiB",
            n as f64 / 1048576.0
        )
    } else {
        let dev = mount
            .loop_dev
            .as_deref()
            .and_then(|d| d.rsplit('/').next())
            .context("no loop device")?;
        std::fs::write(format!("/sys/fs/ext4/{dev}/trigger_fs_error"), "1")
            .context("writing trigger_fs_error")?;
        let ro = read_only(&mount.dir);
        format!(
            "ext4 error triggered; the mount is {}",
            if ro { "read-only" } else { "STILL read-write" }
        )
    };
    o.observed.push(format!(
        "cloud link cut 3 s before the fault (spool unacked records then {backlog:.0}); {what}"
    ));
    let during = acks_during(load, hold).await;
    let m1 = bed.metrics().await;
    let alive_during = bed.sluice.running();
    o.observed.push(format!(
        "acknowledgements: {:.0}/s before, {} in the {} s of the fault; sluice {} at its end; spool failures counted meanwhile {}, full {}",
        before as f64 / 2.0,
        during,
        hold.as_secs(),
        if alive_during { "running" } else { "EXITED" },
        metric_sum(&m1, "sluice_spool_failures_total").unwrap_or(0.0)
            - metric_sum(&m0, "sluice_spool_failures_total").unwrap_or(0.0),
        metric_sum(&m1, "sluice_spool_full_total").unwrap_or(0.0)
            - metric_sum(&m0, "sluice_spool_full_total").unwrap_or(0.0),
    ));
    if !alive_during {
        o.observed
            .push(format!("sluice's last words: {}", bed.sluice.stderr_tail()));
    }
    let mut restarted = false;
    if name == "disk-full" {
        let _ = std::fs::remove_file(&fill);
    } else {
        let d = mount.dir.display().to_string();
        if let Err(e) = run(&["mount", "-o", "remount,rw", &d]) {
            // Linux 6.x keeps an ext4 that hit an error in `emergency_ro` until it is
            // unmounted: stop sluice, repair, start it again (said in the report).
            let clean = bed.sluice.stop().await;
            let fsck = tokio::task::block_in_place(|| mount.repair())?;
            o.observed.push(format!(
                "remount read-write refused ({}); so sluice was stopped (SIGTERM; exited by itself: {clean}), the file system unmounted, checked ({fsck}) and mounted again ({}), and sluice started on it",
                e.to_string().lines().next().unwrap_or(""),
                if read_only(&mount.dir) { "read-only!" } else { "read-write" },
            ));
            bed.sluice.start()?;
            bed.sluice.wait_ready().await?;
            load.reassociate_phd().await?;
            restarted = true;
        }
    }
    bed.net.restore(0).map_err(anyhow::Error::msg)?;
    let freed = Instant::now();
    // Resumed: the acknowledgement rate is back to half of what it was before.
    let per_s_before = before as f64 / 2.0;
    let mut resumed = None;
    while freed.elapsed() < Duration::from_secs(30) {
        let n = acks_during(load, Duration::from_secs(1)).await as f64;
        if n >= per_s_before / 2.0 {
            resumed = Some(freed.elapsed());
            break;
        }
    }
    let m2 = bed.metrics().await;
    let same_process = bed.sluice.pid() == pid && bed.sluice.running();
    let delta = |a: &str, b: &str, n: &str| {
        metric_sum(b, n).unwrap_or(0.0) - metric_sum(a, n).unwrap_or(0.0)
    };
    o.observed.push(format!(
        "{}, cloud link restored; acknowledgements back to half the earlier rate {}; same sluice process: {}; spool failures after that {}",
        if name == "disk-full" { "filler deleted" } else if restarted { "repaired" } else { "remounted read-write" },
        resumed.map_or("NOT within 30 s".to_string(), |d| format!("after {:.1} s", d.as_secs_f64())),
        if same_process { "yes" } else { "no" },
        if same_process {
            delta(&m1, &m2, "sluice_spool_failures_total").to_string()
        } else {
            "(new process)".to_string()
        },
    ));
    if restarted {
        o.check = "after the repair and a restart (the kernel keeps a failed ext4 read-only until unmounted), resumed within 30 s".to_string();
        o.check_met = resumed.is_some() && bed.sluice.running();
    } else {
        o.check =
            "resumed without a restart within 30 s of the space/write access (and the cloud) returning"
                .to_string();
        o.check_met = resumed.is_some() && same_process;
    }
    Ok(())
}

fn read_only(dir: &Path) -> bool {
    let d = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 3 && Path::new(f[1]) == d)
                .then(|| f[3].split(',').any(|o| o == "ro" || o == "emergency_ro"))
        })
        .next_back()
        .unwrap_or(false)
}
