//! Shared helpers for the spool's integration tests (included with `mod common;`).
#![allow(dead_code)]

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sluice_spool::fault::FaultFs;
use sluice_spool::{FsyncPolicy, FullPolicy, Spool, SpoolConfig, SpoolFile, SpoolFs, SpoolRecord};

pub fn small_config() -> SpoolConfig {
    SpoolConfig {
        segment_bytes: 512,
        max_bytes: 64 << 10,
        when_full: FullPolicy::Block,
        fsync: FsyncPolicy::Interval(Duration::from_millis(10)),
        max_record_bytes: 128,
        max_batch_bytes: 16 << 10,
        ack_window: 1024,
    }
}

pub fn body(i: u64) -> Vec<u8> {
    let mut b = i.to_le_bytes().to_vec();
    b.extend(std::iter::repeat_n((i % 251) as u8, (i % 40) as usize));
    b
}

pub fn read_all(spool: &mut Spool) -> Vec<SpoolRecord> {
    let mut cur = spool.read_cursor();
    let mut out = Vec::new();
    while spool.read(&mut cur, 1000, 1 << 20, &mut out).expect("read") > 0 {}
    out
}

pub fn open_fault(fs: &FaultFs, cfg: SpoolConfig) -> (Spool, sluice_spool::RecoveryReport) {
    Spool::open_with_fs(Arc::new(fs.clone()), "/spool", cfg).expect("open")
}

/// A [`SpoolFs`] over [`FaultFs`] that can be full: while it is, an append writes part of
/// its buffer and fails with `ENOSPC` (a short write, then no space), as on a real disk.
/// Everything else passes through (creating an empty file, renaming and removing need no
/// data blocks; fsync of what was written succeeds).
#[derive(Clone)]
pub struct FullFs {
    pub inner: FaultFs,
    pub full: Arc<AtomicBool>,
}

struct FullFile {
    inner: Arc<dyn SpoolFile>,
    full: Arc<AtomicBool>,
}

fn enospc() -> io::Error {
    io::Error::from_raw_os_error(28)
}

impl SpoolFile for FullFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_exact_at(buf, offset)
    }
    fn append(&self, buf: &[u8]) -> io::Result<()> {
        if self.full.load(Ordering::Relaxed) {
            self.inner.append(&buf[..buf.len() / 2])?;
            return Err(enospc());
        }
        self.inner.append(buf)
    }
    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
    fn size(&self) -> io::Result<u64> {
        self.inner.size()
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        self.inner.truncate(len)
    }
}

impl FullFs {
    fn wrap(&self, f: io::Result<Arc<dyn SpoolFile>>) -> io::Result<Arc<dyn SpoolFile>> {
        let full = self.full.clone();
        f.map(|inner| Arc::new(FullFile { inner, full }) as Arc<dyn SpoolFile>)
    }
}

impl SpoolFs for FullFs {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.inner.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<(String, u64)>> {
        self.inner.list(dir)
    }
    fn create(&self, path: &Path, exclusive: bool) -> io::Result<Arc<dyn SpoolFile>> {
        self.wrap(self.inner.create(path, exclusive))
    }
    fn open(&self, path: &Path) -> io::Result<Arc<dyn SpoolFile>> {
        self.wrap(self.inner.open(path))
    }
    fn open_read(&self, path: &Path) -> io::Result<Arc<dyn SpoolFile>> {
        self.wrap(self.inner.open_read(path))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.inner.rename(from, to)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        self.inner.remove(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.inner.sync_dir(dir)
    }
}
