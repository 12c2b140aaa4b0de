//! The space reserve: `DIR/space.reserve`, a file of [`RESERVE_BYTES`] zeros that holds
//! disk blocks for the spool's bookkeeping, so that a full file system never wedges it.
//!
//! Owns: creating, renewing and releasing the reserve file. Does not own: when (the commit
//! job and `Spool::open` decide). Why: on a full file system the spool must still persist its
//! ack cursor (a new 20-byte file, i.e. one new block) before it may delete acknowledged
//! segments, which is what frees space; and a restart must still create a segment and, after
//! damage, a quarantine copy. When a write fails for lack of space the reserve is deleted,
//! and those writes use its blocks. Before the spool accepts records again it writes the
//! reserve anew: if that fails there is still no room, and the spool stays stalled.
//!
//! Invariant: the file is complete or absent (written as `space.reserve.tmp`, renamed; a
//! leftover `.tmp` is removed by recovery like any other). Its bytes are not counted in
//! `max_bytes` (it is not a segment).

use std::io;
use std::path::Path;

use crate::fs::SpoolFs;

/// File name of the reserve inside the spool directory.
pub const RESERVE_FILE: &str = "space.reserve";
const RESERVE_TMP: &str = "space.reserve.tmp";
/// Size of the reserve: room for a cursor file, a segment header and a quarantine directory
/// even with 64 KiB blocks.
pub const RESERVE_BYTES: u64 = 256 << 10;
const CHUNK: usize = 64 << 10;

/// True when the reserve file is present with its full size.
pub(crate) fn present(fs: &dyn SpoolFs, dir: &Path) -> io::Result<bool> {
    Ok(fs
        .list(dir)?
        .iter()
        .any(|(n, len)| n == RESERVE_FILE && *len == RESERVE_BYTES))
}

/// Creates the reserve unless it is present. On failure nothing of it is left behind.
pub(crate) fn ensure(fs: &dyn SpoolFs, dir: &Path, sync: bool) -> io::Result<()> {
    if present(fs, dir)? {
        return Ok(());
    }
    write(fs, dir, sync)
}

/// Writes the reserve anew (a probe that the file system takes writes again): removes it,
/// then creates it. On failure the reserve is absent.
pub(crate) fn renew(fs: &dyn SpoolFs, dir: &Path, sync: bool) -> io::Result<()> {
    release(fs, dir)?;
    write(fs, dir, sync)
}

/// Deletes the reserve, handing its blocks to the spool's bookkeeping writes.
pub(crate) fn release(fs: &dyn SpoolFs, dir: &Path) -> io::Result<()> {
    match fs.remove(&dir.join(RESERVE_FILE)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn write(fs: &dyn SpoolFs, dir: &Path, sync: bool) -> io::Result<()> {
    let tmp = dir.join(RESERVE_TMP);
    let result = (|| {
        let file = fs.create(&tmp, false)?;
        let zeros = vec![0u8; CHUNK];
        let mut left = RESERVE_BYTES;
        while left > 0 {
            let n = left.min(CHUNK as u64) as usize;
            file.append(&zeros[..n])?;
            left -= n as u64;
        }
        if sync {
            file.sync()?;
        }
        fs.rename(&tmp, &dir.join(RESERVE_FILE))?;
        if sync {
            fs.sync_dir(dir)?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs.remove(&tmp);
    }
    result
}
