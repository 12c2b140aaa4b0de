//! A fault-injecting, crash-simulating in-memory [`SpoolFs`] for tests.
//!
//! Owns: an in-memory model of a POSIX file system with the durability rules the spool relies
//! on, plus failure injection. Does not own: any spool logic. It is public so integration tests
//! and the later bench tool can drive the spool through it; production code uses
//! [`crate::RealFs`].
//!
//! Durability model (deliberately pessimistic, and no stronger than ext4/xfs give):
//! - a file's bytes are durable up to its last [`SpoolFile::sync`]; at a crash each file keeps
//!   its durable bytes plus an arbitrary prefix of what was appended since (a torn tail);
//!   a file whose unsynced change was a truncation falls back to its durable bytes;
//! - directory changes (create, rename, remove) are durable after
//!   [`SpoolFs::sync_dir`] of their directory; at a crash an arbitrary prefix of the
//!   unsynced directory changes survives, in order;
//! - after a crash every handle opened before it fails with an error (the process died).
//!
//! Failure injection: [`FaultFs::fail_op`] makes the n-th mutating operation from now fail
//! (a failing append first writes an arbitrary prefix of its buffer; a failing sync makes
//! nothing durable); [`FaultFs::fail_op_with`] does the same with a given error kind (e.g.
//! `StorageFull`, `ReadOnlyFilesystem`).
//!
//! Storage that gives out (the spool's stalled state): [`FaultFs::set_capacity`] bounds the
//! bytes of all files together like a full disk does — an append that does not fit writes
//! what fits and fails with `StorageFull` (`ENOSPC`); creating, renaming, removing and
//! truncating still work, and removing or truncating frees room. [`FaultFs::set_read_only`]
//! makes every change fail with `ReadOnlyFilesystem` (`EROFS`) until it is cleared; reads
//! and fsyncs still work.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::fs::{SpoolFile, SpoolFs};

/// The in-memory file system. Cheap to clone; clones share state.
#[derive(Clone)]
pub struct FaultFs {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct Inode {
    data: Vec<u8>,
    durable: Vec<u8>,
}

enum DirOp {
    Link(PathBuf, usize),
    Unlink(PathBuf),
    Rename(PathBuf, PathBuf),
}

impl DirOp {
    fn dirs(&self) -> Vec<&Path> {
        fn parent(p: &Path) -> &Path {
            p.parent().unwrap_or(Path::new(""))
        }
        match self {
            DirOp::Link(p, _) | DirOp::Unlink(p) => vec![parent(p)],
            DirOp::Rename(a, b) => vec![parent(a), parent(b)],
        }
    }
    fn apply(&self, names: &mut BTreeMap<PathBuf, usize>) {
        match self {
            DirOp::Link(p, ino) => {
                names.insert(p.clone(), *ino);
            }
            DirOp::Unlink(p) => {
                names.remove(p);
            }
            DirOp::Rename(a, b) => {
                if let Some(ino) = names.remove(a) {
                    names.insert(b.clone(), ino);
                }
            }
        }
    }
}

struct State {
    inodes: Vec<Inode>,
    names: BTreeMap<PathBuf, usize>,
    durable_names: BTreeMap<PathBuf, usize>,
    pending: Vec<DirOp>,
    epoch: u64,
    countdown: Option<u64>,
    rng: u64,
    /// Mutating operations performed so far (for tests that crash "at every write").
    ops: u64,
    /// The error kind of the injected failure (`fail_op_with`).
    fail_kind: io::ErrorKind,
    /// Bound on the bytes of all linked files.
    capacity: Option<u64>,
    read_only: bool,
}

impl State {
    fn next_rand(&mut self) -> u64 {
        // xorshift64*: deterministic, no dependency.
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Counts a mutating operation; `true` when this one must fail.
    fn tick(&mut self) -> bool {
        self.ops += 1;
        match self.countdown {
            Some(0) | None => false,
            Some(1) => {
                self.countdown = None;
                true
            }
            Some(n) => {
                self.countdown = Some(n - 1);
                false
            }
        }
    }

    fn record(&mut self, op: DirOp) {
        op.apply(&mut self.names);
        self.pending.push(op);
    }

    fn injected(&self) -> io::Error {
        io::Error::new(self.fail_kind, "injected I/O error")
    }

    /// `EROFS` while the file system is read-only.
    fn check_writable(&self) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::new(
                io::ErrorKind::ReadOnlyFilesystem,
                "read-only file system (injected)",
            ));
        }
        Ok(())
    }

    /// Bytes of all linked files.
    fn used(&self) -> u64 {
        let mut inos: Vec<usize> = self.names.values().copied().collect();
        inos.sort_unstable();
        inos.dedup();
        inos.iter().map(|&i| self.inodes[i].data.len() as u64).sum()
    }
}

fn no_space() -> io::Error {
    io::Error::new(
        io::ErrorKind::StorageFull,
        "no space left on device (injected)",
    )
}

fn stale() -> io::Error {
    io::Error::other("file handle from before a simulated crash")
}

impl FaultFs {
    /// An empty file system; `seed` drives every arbitrary choice (torn lengths, which
    /// directory changes survive).
    pub fn new(seed: u64) -> Self {
        FaultFs {
            state: Arc::new(Mutex::new(State {
                inodes: Vec::new(),
                names: BTreeMap::new(),
                durable_names: BTreeMap::new(),
                pending: Vec::new(),
                epoch: 0,
                countdown: None,
                rng: seed | 1,
                ops: 0,
                fail_kind: io::ErrorKind::Other,
                capacity: None,
                read_only: false,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock only happens inside a failing test.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the `n`-th mutating operation from now fail (`n >= 1`); `0` clears.
    pub fn fail_op(&self, n: u64) {
        self.fail_op_with(n, io::ErrorKind::Other);
    }

    /// [`FaultFs::fail_op`] with an error of `kind` (`StorageFull`, `ReadOnlyFilesystem`...).
    pub fn fail_op_with(&self, n: u64, kind: io::ErrorKind) {
        let mut s = self.lock();
        s.countdown = if n == 0 { None } else { Some(n) };
        s.fail_kind = kind;
    }

    /// Bounds the bytes of all files together (`None`: unbounded), as a full disk does.
    pub fn set_capacity(&self, bytes: Option<u64>) {
        self.lock().capacity = bytes;
    }

    /// Bytes of all files together.
    pub fn used_bytes(&self) -> u64 {
        self.lock().used()
    }

    /// Makes every change fail with `ReadOnlyFilesystem` (true) or work again (false).
    pub fn set_read_only(&self, read_only: bool) {
        self.lock().read_only = read_only;
    }

    /// Mutating operations performed so far.
    pub fn ops(&self) -> u64 {
        self.lock().ops
    }

    /// Simulates power loss: drops what was not made durable, keeping arbitrary torn tails
    /// and an arbitrary prefix of unsynced directory changes. Clears injected failures.
    pub fn crash(&self) {
        let mut s = self.lock();
        s.countdown = None;
        s.epoch += 1;
        let keep_ops = if s.pending.is_empty() {
            0
        } else {
            (s.next_rand() % (s.pending.len() as u64 + 1)) as usize
        };
        let pending = std::mem::take(&mut s.pending);
        let mut names = s.durable_names.clone();
        for op in pending.iter().take(keep_ops) {
            op.apply(&mut names);
        }
        s.durable_names = names.clone();
        s.names = names;
        for i in 0..s.inodes.len() {
            let extra = {
                let ino = &s.inodes[i];
                if ino.data.starts_with(&ino.durable) {
                    ino.data.len() - ino.durable.len()
                } else {
                    0
                }
            };
            let keep = if extra == 0 {
                0
            } else {
                (s.next_rand() % (extra as u64 + 1)) as usize
            };
            let ino = &mut s.inodes[i];
            let new_len = ino.durable.len() + keep;
            if ino.data.starts_with(&ino.durable) {
                ino.data.truncate(new_len);
            } else {
                ino.data = ino.durable.clone();
            }
            ino.durable = ino.data.clone();
        }
    }

    /// Test helper: the current bytes of `path`.
    pub fn read_all(&self, path: &Path) -> Option<Vec<u8>> {
        let s = self.lock();
        let ino = *s.names.get(path)?;
        Some(s.inodes[ino].data.clone())
    }

    /// Test helper: replaces the bytes of `path` and makes them durable (media corruption).
    pub fn overwrite(&self, path: &Path, bytes: Vec<u8>) -> bool {
        let mut s = self.lock();
        let Some(&ino) = s.names.get(path) else {
            return false;
        };
        s.inodes[ino].durable = bytes.clone();
        s.inodes[ino].data = bytes;
        true
    }

    /// Test helper: creates `path` with `bytes`, durable (file and directory entry);
    /// returns true.
    pub fn create_for_test(&self, path: &Path, bytes: Vec<u8>) -> bool {
        let mut s = self.lock();
        s.inodes.push(Inode {
            durable: bytes.clone(),
            data: bytes,
        });
        let ino = s.inodes.len() - 1;
        s.names.insert(path.to_owned(), ino);
        s.durable_names.insert(path.to_owned(), ino);
        true
    }

    /// Test helper: every file path currently present.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.lock().names.keys().cloned().collect()
    }
}

struct FaultFile {
    state: Arc<Mutex<State>>,
    ino: usize,
    epoch: u64,
    writable: bool,
}

impl FaultFile {
    fn lock(&self) -> io::Result<MutexGuard<'_, State>> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.epoch != self.epoch {
            return Err(stale());
        }
        Ok(s)
    }
}

impl SpoolFile for FaultFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let s = self.lock()?;
        let data = &s.inodes[self.ino].data;
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let end = start
            .checked_add(buf.len())
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        let src = data.get(start..end).ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
    fn append(&self, buf: &[u8]) -> io::Result<()> {
        let mut s = self.lock()?;
        if !self.writable {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "read-only handle",
            ));
        }
        s.check_writable()?;
        if s.tick() {
            let n = (s.next_rand() % (buf.len() as u64 + 1)) as usize;
            s.inodes[self.ino].data.extend_from_slice(&buf[..n]);
            return Err(s.injected());
        }
        if let Some(cap) = s.capacity {
            let room = cap.saturating_sub(s.used()) as usize;
            if room < buf.len() {
                s.inodes[self.ino].data.extend_from_slice(&buf[..room]);
                return Err(no_space());
            }
        }
        s.inodes[self.ino].data.extend_from_slice(buf);
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        let mut s = self.lock()?;
        if s.tick() {
            return Err(s.injected());
        }
        let ino = &mut s.inodes[self.ino];
        ino.durable = ino.data.clone();
        Ok(())
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.lock()?.inodes[self.ino].data.len() as u64)
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        let mut s = self.lock()?;
        if !self.writable {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "read-only handle",
            ));
        }
        s.check_writable()?;
        if s.tick() {
            return Err(s.injected());
        }
        let len = usize::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
        s.inodes[self.ino].data.resize(len, 0);
        Ok(())
    }
}

impl SpoolFs for FaultFs {
    fn create_dir_all(&self, _dir: &Path) -> io::Result<()> {
        Ok(())
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<(String, u64)>> {
        let s = self.lock();
        Ok(s.names
            .iter()
            .filter(|(p, _)| p.parent() == Some(dir))
            .filter_map(|(p, &ino)| {
                let name = p.file_name()?.to_str()?.to_owned();
                Some((name, s.inodes[ino].data.len() as u64))
            })
            .collect())
    }
    fn create(&self, path: &Path, exclusive: bool) -> io::Result<Arc<dyn SpoolFile>> {
        let mut s = self.lock();
        if exclusive && s.names.contains_key(path) {
            return Err(io::ErrorKind::AlreadyExists.into());
        }
        s.check_writable()?;
        if s.tick() {
            return Err(s.injected());
        }
        s.inodes.push(Inode::default());
        let ino = s.inodes.len() - 1;
        s.record(DirOp::Link(path.to_owned(), ino));
        Ok(Arc::new(FaultFile {
            state: self.state.clone(),
            ino,
            epoch: s.epoch,
            writable: true,
        }))
    }
    fn open(&self, path: &Path) -> io::Result<Arc<dyn SpoolFile>> {
        let s = self.lock();
        let ino = *s.names.get(path).ok_or(io::ErrorKind::NotFound)?;
        Ok(Arc::new(FaultFile {
            state: self.state.clone(),
            ino,
            epoch: s.epoch,
            writable: true,
        }))
    }
    fn open_read(&self, path: &Path) -> io::Result<Arc<dyn SpoolFile>> {
        let s = self.lock();
        let ino = *s.names.get(path).ok_or(io::ErrorKind::NotFound)?;
        Ok(Arc::new(FaultFile {
            state: self.state.clone(),
            ino,
            epoch: s.epoch,
            writable: false,
        }))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut s = self.lock();
        if !s.names.contains_key(from) {
            return Err(io::ErrorKind::NotFound.into());
        }
        s.check_writable()?;
        if s.tick() {
            return Err(s.injected());
        }
        s.record(DirOp::Rename(from.to_owned(), to.to_owned()));
        Ok(())
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        let mut s = self.lock();
        if !s.names.contains_key(path) {
            return Err(io::ErrorKind::NotFound.into());
        }
        s.check_writable()?;
        if s.tick() {
            return Err(s.injected());
        }
        s.record(DirOp::Unlink(path.to_owned()));
        Ok(())
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut s = self.lock();
        if s.tick() {
            return Err(s.injected());
        }
        // Changes in `dir` become durable, in order; the others stay pending.
        let pending = std::mem::take(&mut s.pending);
        let mut names = s.durable_names.clone();
        let mut rest = Vec::new();
        for op in pending {
            if op.dirs().contains(&dir) {
                op.apply(&mut names);
            } else {
                rest.push(op);
            }
        }
        s.durable_names = names;
        s.pending = rest;
        Ok(())
    }
}
