//! The disk a scenario writes to: a default directory on a real disk (not a tmpfs), the file
//! system holding a directory (type, device, mount point) and a directory's size.

use std::path::{Path, PathBuf};

use serde::Serialize;

/// Where the files were.
#[derive(Debug, Clone, Serialize)]
pub struct FileSystem {
    pub dir: String,
    pub fs_type: String,
    pub mount_point: String,
    pub device: String,
}

/// The file system holding `dir`, from `/proc/self/mountinfo` (longest matching mount point).
pub fn file_system(dir: &Path) -> FileSystem {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let mut best: Option<(String, String, String)> = None;
    if let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") {
        for line in text.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let Some(sep) = fields.iter().position(|f| *f == "-") else {
                continue;
            };
            let (Some(mount), Some(fs_type), Some(device)) =
                (fields.get(4), fields.get(sep + 1), fields.get(sep + 2))
            else {
                continue;
            };
            let mount = mount.replace("\\040", " ");
            if dir.starts_with(&mount) && best.as_ref().is_none_or(|b| mount.len() >= b.0.len()) {
                best = Some((mount, fs_type.to_string(), device.to_string()));
            }
        }
    }
    let (mount_point, fs_type, device) =
        best.unwrap_or_else(|| ("?".into(), "unknown".into(), "?".into()));
    FileSystem {
        dir: dir.display().to_string(),
        fs_type,
        mount_point,
        device,
    }
}

/// Apparent size of all files under `dir`.
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e.metadata().map(|m| m.len()).unwrap_or(0),
            Err(_) => 0,
        })
        .sum()
}

/// `/var/tmp` (kept on disk across reboots, so not a tmpfs on usual systems), or the current
/// directory when `/var/tmp` is a tmpfs or missing.
pub fn default_dir() -> PathBuf {
    let var_tmp = PathBuf::from("/var/tmp");
    if var_tmp.is_dir() && file_system(&var_tmp).fs_type != "tmpfs" {
        var_tmp
    } else {
        PathBuf::from(".")
    }
}
