//! The persistent ack cursor: `DIR/ack.cursor`.
//!
//! Owns: the cursor file's format and its atomic replacement. Does not own: when the cursor
//! is written (the commit job decides). Invariant: the file on disk is always either the old
//! or the new complete cursor, never a mix: it is written as `ack.cursor.tmp`, fsynced,
//! renamed over `ack.cursor`, and the directory is fsynced.
//!
//! Format (20 bytes, little-endian): `0..8` magic `b"SLSPACK\x01"`, `8..16` the ack cursor
//! (u64: every record with seq <= it is acknowledged by the cloud), `16..20` crc32c of
//! bytes `0..16`.

use std::io;
use std::path::{Path, PathBuf};

use crate::fs::SpoolFs;

/// File name of the cursor inside the spool directory.
pub const CURSOR_FILE: &str = "ack.cursor";
const CURSOR_TMP: &str = "ack.cursor.tmp";
const CURSOR_MAGIC: [u8; 8] = *b"SLSPACK\x01";
const CURSOR_LEN: usize = 20;

/// What went wrong reading the cursor file.
#[derive(Debug, thiserror::Error)]
pub enum CursorError {
    /// The file exists but is not a valid cursor (wrong length, magic or checksum).
    #[error("ack cursor file {path} is damaged ({reason}); recovery will re-deliver from the oldest record")]
    Damaged { path: PathBuf, reason: &'static str },
    /// The file could not be read.
    #[error("reading ack cursor file {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// Encodes a cursor value.
pub fn encode(ack: u64) -> [u8; CURSOR_LEN] {
    let mut b = [0u8; CURSOR_LEN];
    b[0..8].copy_from_slice(&CURSOR_MAGIC);
    b[8..16].copy_from_slice(&ack.to_le_bytes());
    let crc = crc32c::crc32c(&b[0..16]);
    b[16..20].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Reads the cursor; `Ok(None)` when there is no cursor file.
pub fn read(fs: &dyn SpoolFs, dir: &Path) -> Result<Option<u64>, CursorError> {
    let path = dir.join(CURSOR_FILE);
    let io_err = |source| CursorError::Io {
        path: path.clone(),
        source,
    };
    let len = match fs
        .list(dir)
        .map_err(io_err)?
        .into_iter()
        .find(|(n, _)| n == CURSOR_FILE)
    {
        Some((_, len)) => len,
        None => return Ok(None),
    };
    if len != CURSOR_LEN as u64 {
        return Err(CursorError::Damaged {
            path,
            reason: "wrong length",
        });
    }
    let file = fs.open_read(&path).map_err(io_err)?;
    let mut b = [0u8; CURSOR_LEN];
    file.read_exact_at(&mut b, 0).map_err(io_err)?;
    if b[0..8] != CURSOR_MAGIC {
        return Err(CursorError::Damaged {
            path,
            reason: "bad magic",
        });
    }
    if crc32c::crc32c(&b[0..16]).to_le_bytes() != b[16..20] {
        return Err(CursorError::Damaged {
            path,
            reason: "checksum mismatch",
        });
    }
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[8..16]);
    Ok(Some(u64::from_le_bytes(v)))
}

/// Atomically replaces the cursor file. With `sync` false (fsync policy `never`) the
/// rename still happens but nothing is fsynced.
pub fn write(fs: &dyn SpoolFs, dir: &Path, ack: u64, sync: bool) -> io::Result<()> {
    let tmp = dir.join(CURSOR_TMP);
    let file = fs.create(&tmp, false)?;
    file.append(&encode(ack))?;
    if sync {
        file.sync()?;
    }
    fs.rename(&tmp, &dir.join(CURSOR_FILE))?;
    if sync {
        fs.sync_dir(dir)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::FaultFs;

    #[test]
    fn a_written_cursor_reads_back() {
        let fs = FaultFs::new(1);
        let dir = Path::new("/s");
        assert_eq!(read(&fs, dir).ok().flatten(), None);
        write(&fs, dir, 12345, true).expect("write");
        assert_eq!(read(&fs, dir).ok().flatten(), Some(12345));
    }

    #[test]
    fn a_damaged_cursor_is_reported_not_trusted() {
        let fs = FaultFs::new(1);
        let dir = Path::new("/s");
        write(&fs, dir, 7, true).expect("write");
        let path = dir.join(CURSOR_FILE);
        let mut b = fs.read_all(&path).expect("exists");
        b[9] ^= 0x10;
        fs.overwrite(&path, b);
        assert!(matches!(read(&fs, dir), Err(CursorError::Damaged { .. })));
    }

    #[test]
    fn a_crash_during_replacement_leaves_the_old_or_the_new_cursor() {
        for seed in 1..200 {
            let fs = FaultFs::new(seed);
            let dir = Path::new("/s");
            write(&fs, dir, 1, true).expect("write");
            fs.fail_op(1 + seed % 5);
            let _ = write(&fs, dir, 2, true);
            fs.crash();
            let got = read(&fs, dir).expect("never damaged").expect("present");
            assert!(got == 1 || got == 2, "seed {seed}: {got}");
        }
    }
}
