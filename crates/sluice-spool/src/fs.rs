//! The file-system seam: every byte the spool reads or writes goes through [`SpoolFs`].
//!
//! Owns: the small set of file operations the spool needs, and [`RealFs`], their
//! implementation on `std::fs` (Unix: positional reads). Does not own: layout decisions or
//! error policy. Invariant: [`SpoolFile::append`] only ever adds bytes at the end of a file
//! (the spool never rewrites bytes in place), which is what makes "durable prefix plus
//! a torn tail" the only crash outcome that recovery has to handle for a segment.
//!
//! [`RealFs`] holds no file open for writing between writes: a [`SpoolFile`] keeps a
//! read-only descriptor (reads, `fdatasync`) and opens its path for appending only for the
//! duration of an append or a truncation. So an operator can remount the spool's file system
//! read-only under a running gateway (`mount -o remount,ro` refuses with "busy" while a
//! process has a file open for writing); the spool then stalls and resumes after
//! `remount,rw` (see the crate docs). It also means a write to a segment whose file was
//! removed under the spool fails instead of vanishing into an unlinked inode.
//!
//! A fault-injecting implementation for tests lives in [`crate::fault`].

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An open file. Shared (`Arc`) so a commit job can write and fsync it on another thread
/// while the owning shard keeps reading committed bytes.
pub trait SpoolFile: Send + Sync {
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Appends all of `buf` at the end of the file.
    fn append(&self, buf: &[u8]) -> io::Result<()>;
    /// Makes the file's data durable (`fdatasync`).
    fn sync(&self) -> io::Result<()>;
    /// Current length in bytes.
    fn size(&self) -> io::Result<u64>;
    /// Cuts the file to `len` bytes.
    fn truncate(&self, len: u64) -> io::Result<()>;
}

/// Directory-level operations.
pub trait SpoolFs: Send + Sync {
    /// Creates `dir` and its parents if missing.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Names and lengths of the regular files directly inside `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<(String, u64)>>;
    /// Creates a file for reading and appending. `exclusive`: fail if it exists; otherwise an
    /// existing file is emptied.
    fn create(&self, path: &Path, exclusive: bool) -> io::Result<Arc<dyn SpoolFile>>;
    /// Opens an existing file for reading and appending (recovery truncates through it).
    fn open(&self, path: &Path) -> io::Result<Arc<dyn SpoolFile>>;
    /// Opens an existing file read-only (operator tools, which must not modify the spool).
    fn open_read(&self, path: &Path) -> io::Result<Arc<dyn SpoolFile>>;
    /// Atomically renames `from` to `to`, replacing `to`.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes a file.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Makes `dir`'s entries (creations, renames, removals) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
}

/// [`SpoolFs`] on the real file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealFs;

/// A file: a read-only descriptor, and its path for the writes (see the module docs).
struct RealFile {
    file: File,
    /// `None`: opened read-only (operator tools); writes fail.
    path: Option<PathBuf>,
}

impl RealFile {
    /// A descriptor for one write, closed when it is dropped.
    fn writer(&self) -> io::Result<File> {
        let Some(path) = &self.path else {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "file opened read-only",
            ));
        };
        let w = OpenOptions::new().append(true).open(path)?;
        // The path must still name the file this handle was opened on (not a file created
        // in its place after a removal).
        use std::os::unix::fs::MetadataExt;
        let (a, b) = (w.metadata()?, self.file.metadata()?);
        if (a.dev(), a.ino()) != (b.dev(), b.ino()) {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the file was replaced or removed",
            ));
        }
        Ok(w)
    }
}

impl SpoolFile for RealFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
    fn append(&self, buf: &[u8]) -> io::Result<()> {
        self.writer()?.write_all(buf)
    }
    fn sync(&self) -> io::Result<()> {
        // Linux syncs a file's data through any descriptor of it, a read-only one included.
        self.file.sync_data()
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        self.writer()?.set_len(len)
    }
}

impl SpoolFs for RealFs {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<(String, u64)>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if meta.is_file() {
                if let Some(name) = entry.file_name().to_str() {
                    out.push((name.to_owned(), meta.len()));
                }
            }
        }
        Ok(out)
    }
    fn create(&self, path: &Path, exclusive: bool) -> io::Result<Arc<dyn SpoolFile>> {
        let mut o = OpenOptions::new();
        o.read(true).append(true);
        if exclusive {
            o.create_new(true);
        } else {
            o.create(true);
        }
        let f = o.open(path)?;
        if !exclusive {
            f.set_len(0)?;
        }
        // Closed now: writes open the path for as long as they take.
        drop(f);
        self.open(path)
    }
    fn open(&self, path: &Path) -> io::Result<Arc<dyn SpoolFile>> {
        Ok(Arc::new(RealFile {
            file: File::open(path)?,
            path: Some(path.to_owned()),
        }))
    }
    fn open_read(&self, path: &Path) -> io::Result<Arc<dyn SpoolFile>> {
        Ok(Arc::new(RealFile {
            file: File::open(path)?,
            path: None,
        }))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

/// A file created by its first append: the active segment of a spool opened on a file system
/// that refused to create it (read-only, or full). Until then it is empty; the append that
/// creates it runs in a commit job, where a refusal stalls the spool instead of failing it.
pub(crate) struct LazyFile {
    fs: Arc<dyn SpoolFs>,
    path: PathBuf,
    file: std::sync::Mutex<Option<Arc<dyn SpoolFile>>>,
}

impl LazyFile {
    pub(crate) fn new(fs: Arc<dyn SpoolFs>, path: PathBuf) -> LazyFile {
        LazyFile {
            fs,
            path,
            file: std::sync::Mutex::new(None),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Arc<dyn SpoolFile>>> {
        // Poisoned only by a panic in another thread's file operation: the value is intact.
        self.file.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self) -> Option<Arc<dyn SpoolFile>> {
        self.lock().clone()
    }
}

impl SpoolFile for LazyFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match self.get() {
            Some(f) => f.read_exact_at(buf, offset),
            None if buf.is_empty() => Ok(()),
            None => Err(io::ErrorKind::UnexpectedEof.into()),
        }
    }
    fn append(&self, buf: &[u8]) -> io::Result<()> {
        let file = {
            let mut g = self.lock();
            match &*g {
                Some(f) => f.clone(),
                None => {
                    let f = self.fs.create(&self.path, true)?;
                    *g = Some(f.clone());
                    f
                }
            }
        };
        file.append(buf)
    }
    fn sync(&self) -> io::Result<()> {
        self.get().map_or(Ok(()), |f| f.sync())
    }
    fn size(&self) -> io::Result<u64> {
        self.get().map_or(Ok(0), |f| f.size())
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        match self.get() {
            Some(f) => f.truncate(len),
            None if len == 0 => Ok(()),
            None => Err(io::ErrorKind::InvalidInput.into()),
        }
    }
}

/// Path of a segment file: `DIR/{first_seq:020}.seg`.
pub fn segment_path(dir: &Path, first_seq: u64) -> PathBuf {
    dir.join(format!("{first_seq:020}.seg"))
}

/// The first sequence number encoded in a segment file name, if `name` is one.
pub fn parse_segment_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".seg")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_round_trip_and_sort_by_sequence() {
        let p = segment_path(Path::new("/d"), 42);
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        assert_eq!(name, "00000000000000000042.seg");
        assert_eq!(parse_segment_name(name), Some(42));
        assert!(segment_path(Path::new("/d"), 9) < segment_path(Path::new("/d"), 10));
        assert_eq!(parse_segment_name("42.seg"), None);
        assert_eq!(parse_segment_name("0000000000000000004x.seg"), None);
        assert_eq!(parse_segment_name("00000000000000000042.seg.tmp"), None);
    }
}
