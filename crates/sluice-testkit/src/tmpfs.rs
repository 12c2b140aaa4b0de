//! A tmpfs of a given size mounted on a temporary directory, for tests of what happens when a
//! file system fills up or turns read-only (the spool's stall: docs/spool.md). Root only.
//!
//! Owns: the mount and the directory; [`Tmpfs`] unmounts on drop (lazily if something still
//! holds a file there). Does not own: what is put in it. Invariant: a mount this creates is
//! gone when its handle is dropped, even after a panic.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A mounted tmpfs; unmounted on drop.
pub struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (`mount -o size=...`, e.g. `"16m"`) on a new temporary
    /// directory. Fails (with mount's message) when not root or mounting is not allowed: a
    /// test then says it skipped and why.
    pub fn mount(size: &str) -> Result<Tmpfs, String> {
        let dir = tempfile::tempdir().map_err(|e| format!("tempdir: {e}"))?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if out.status.success() {
            Ok(Tmpfs { dir })
        } else {
            Err(format!(
                "cannot mount a tmpfs (needs root): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `mount -o remount,{opts}` (`"ro"`, `"rw"`). The kernel refuses `ro` ("busy") while a
    /// process holds a file there open for writing.
    pub fn remount(&self, opts: &str) -> Result<(), String> {
        let o = Command::new("mount")
            .args(["-o", &format!("remount,{opts}")])
            .arg(self.path())
            .output()
            .map_err(|e| e.to_string())?;
        if o.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&o.stderr).trim().to_string())
        }
    }

    /// Writes zeros to `name` in the mount until the file system is full; returns its path
    /// (remove it to free the space).
    pub fn fill(&self, name: &str) -> std::io::Result<PathBuf> {
        let path = self.path().join(name);
        let mut f = std::fs::File::create(&path)?;
        let chunk = vec![0u8; 64 << 10];
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::StorageFull => break,
                Err(e) => return Err(e),
            }
        }
        Ok(path)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let plain = Command::new("umount")
            .arg(self.path())
            .stderr(Stdio::null())
            .status();
        if !plain.is_ok_and(|s| s.success()) {
            // Something still holds a file open: detach it now, the kernel frees it later.
            let _ = Command::new("umount").arg("-l").arg(self.path()).status();
        }
    }
}
