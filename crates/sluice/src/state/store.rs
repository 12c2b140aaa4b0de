//! The state directory: one snapshot and one change log, their loading and their compaction.
//!
//! Owns: the files under `[state] dir` and the order of writes that makes them
//! crash-consistent. Does not own: what records mean (`image`) or when to write (`writer`).
//!
//! Layout:
//! ```text
//! DIR/snapshot        b"SLSTSNP\x01", generation u64 LE, then frames: Clock, the image's records
//! DIR/log.{gen:020}   b"SLSTLOG\x01", generation u64 LE, then frames: per commit, Clock + changes
//! DIR/*.tmp           a snapshot being written; removed at load
//! ```
//! The state is the snapshot's records followed by those of the log of the same generation,
//! up to the first frame that does not check (the torn tail of a commit cut by a crash).
//!
//! Compaction to generation `g + 1`: write `snapshot.tmp` (the whole image), fsync it, rename
//! it over `snapshot`, fsync the directory, create `log.{g+1}` (header, fsync, directory
//! fsync), then delete `log.{g}`. A crash before the rename leaves snapshot `g` + `log.{g}`;
//! after it, snapshot `g + 1` (+ its log, empty or absent): both are states that existed.
//! Every record of a log is applied in order, and a prefix of a commit is a state that
//! existed too: each change was made alone by the shard or control plane that logged it.
//!
//! Clocks: deadlines are milliseconds on the writing process's monotonic clock. At load they
//! are moved to this process's clock using the last `Clock` record: what was left of each
//! deadline then, minus the wall-clock time since (counted as 0 when the wall clock is now
//! *behind* the last commit, e.g. a Raspberry Pi without an RTC that booted before NTP set
//! its clock: a clock step back never expires anything). A wall clock stepped forward while
//! the gateway was down reads as downtime, as in Mosquitto; a step while it runs changes
//! nothing (the monotonic clock does not step).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::BytesMut;

use super::image::{Bounds, Image};
use super::record::{encode_frame, next_frame, Frame, MonoMs, Record};

const SNAPSHOT_MAGIC: [u8; 8] = *b"SLSTSNP\x01";
const LOG_MAGIC: [u8; 8] = *b"SLSTLOG\x01";
const HEADER_LEN: usize = 16;
const SNAPSHOT: &str = "snapshot";

/// Errors of the state directory.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state directory {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// This process's monotonic clock for state deadlines, and the wall clock.
#[derive(Debug, Clone, Copy)]
pub struct StateClock {
    epoch: Instant,
}

impl Default for StateClock {
    fn default() -> Self {
        StateClock::new()
    }
}

impl StateClock {
    pub fn new() -> StateClock {
        StateClock {
            epoch: Instant::now(),
        }
    }
    pub fn mono(&self, at: Instant) -> MonoMs {
        match at.checked_duration_since(self.epoch) {
            Some(d) => d.as_millis().min(i64::MAX as u128) as i64,
            None => {
                -(self
                    .epoch
                    .duration_since(at)
                    .as_millis()
                    .min(i64::MAX as u128) as i64)
            }
        }
    }
    pub fn now(&self) -> MonoMs {
        self.mono(Instant::now())
    }
    /// The `Instant` of `ms` (clamped to what an `Instant` can hold).
    pub fn instant(&self, ms: MonoMs) -> Instant {
        let d = std::time::Duration::from_millis(ms.unsigned_abs());
        if ms >= 0 {
            self.epoch
                .checked_add(d)
                .unwrap_or_else(|| self.epoch + std::time::Duration::from_secs(100 * 365 * 86_400))
        } else {
            self.epoch.checked_sub(d).unwrap_or(self.epoch)
        }
    }
    pub fn wall_ms() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }
    pub fn clock_record(&self) -> Record {
        Record::Clock {
            mono_ms: self.now(),
            wall_ms: StateClock::wall_ms(),
        }
    }
}

/// What loading found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LoadReport {
    pub generation: u64,
    pub snapshot_records: u64,
    pub log_records: u64,
    /// Frames whose checksum matched but whose body did not decode (skipped).
    pub bad_records: u64,
    /// Bytes after the last good frame of the log (a torn commit) or of a damaged snapshot.
    pub torn_bytes: u64,
    /// A snapshot or log whose header was wrong, ignored.
    pub bad_files: u64,
}

/// Apply every record of the frames in `b` to `image`; returns (records, bad, torn bytes).
pub fn apply_frames(image: &mut Image, mut b: &[u8]) -> (u64, u64, u64) {
    let (mut good, mut bad) = (0, 0);
    loop {
        match next_frame(b) {
            Frame::End => return (good, bad, 0),
            Frame::Torn => return (good, bad, b.len() as u64),
            Frame::Record { record, len, .. } => {
                match record {
                    Ok(r) => {
                        image.apply(r);
                        good += 1;
                    }
                    Err(_) => bad += 1,
                }
                b = &b[len..];
            }
        }
    }
}

fn header(b: &[u8], magic: &[u8; 8]) -> Option<u64> {
    let h = b.get(..HEADER_LEN)?;
    if h[..8] != magic[..] {
        return None;
    }
    let mut g = [0u8; 8];
    g.copy_from_slice(&h[8..16]);
    Some(u64::from_le_bytes(g))
}

fn log_name(generation: u64) -> String {
    format!("log.{generation:020}")
}

fn read_file(path: &Path) -> Result<Option<Vec<u8>>, StoreError> {
    match File::open(path) {
        Ok(mut f) => {
            let mut b = Vec::new();
            f.read_to_end(&mut b).map_err(io(path))?;
            Ok(Some(b))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path)(e)),
    }
}

/// Read the state directory (created if missing) into an image whose deadlines are on
/// `clock`. Damage is skipped and reported, never fatal; only I/O errors are.
pub fn load(
    dir: &Path,
    bounds: Bounds,
    clock: &StateClock,
) -> Result<(Image, LoadReport), StoreError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut report = LoadReport::default();
    let mut image = Image::new(bounds);
    let snap_path = dir.join(SNAPSHOT);
    if let Some(b) = read_file(&snap_path)? {
        match header(&b, &SNAPSHOT_MAGIC) {
            Some(g) => {
                report.generation = g;
                let (good, bad, torn) = apply_frames(&mut image, &b[HEADER_LEN..]);
                report.snapshot_records = good;
                report.bad_records += bad;
                report.torn_bytes += torn;
            }
            None => report.bad_files += 1,
        }
    }
    let log_path = dir.join(log_name(report.generation));
    if let Some(b) = read_file(&log_path)? {
        match header(&b, &LOG_MAGIC) {
            Some(g) if g == report.generation => {
                let (good, bad, torn) = apply_frames(&mut image, &b[HEADER_LEN..]);
                report.log_records = good;
                report.bad_records += bad;
                report.torn_bytes += torn;
            }
            _ => report.bad_files += 1,
        }
    }
    // Leftovers: a snapshot being written, logs of other generations.
    for entry in std::fs::read_dir(dir).map_err(io(dir))?.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let stale_log = name.starts_with("log.") && *name != log_name(report.generation);
        if name.ends_with(".tmp") || stale_log {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    rebase(&mut image, clock);
    Ok((image, report))
}

/// Move the image's deadlines from the writing process's clock to `clock` (module docs).
pub fn rebase(image: &mut Image, clock: &StateClock) {
    let now = clock.now();
    let Some((mono_last, wall_last)) = image.clock else {
        image.rebase(0, now);
        return;
    };
    let downtime = StateClock::wall_ms()
        .saturating_sub(wall_last)
        .min(i64::MAX as u64) as i64;
    let delta = now.saturating_sub(mono_last).saturating_sub(downtime);
    image.rebase(delta, now);
    image.clock = None;
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// The open change log of the current generation.
pub struct Log {
    file: File,
    path: PathBuf,
    pub generation: u64,
    pub len: u64,
    /// Frames written to this log (their seq).
    seq: u64,
}

impl Log {
    /// Append one commit (a `Clock` record then `records`) and fsync it.
    pub fn commit(
        &mut self,
        clock: &StateClock,
        records: &[Record],
        buf: &mut BytesMut,
    ) -> Result<u64, StoreError> {
        buf.clear();
        encode_frame(buf, self.seq, &clock.clock_record());
        self.seq += 1;
        for r in records {
            encode_frame(buf, self.seq, r);
            self.seq += 1;
        }
        self.file.write_all(buf).map_err(io(&self.path))?;
        self.file.sync_data().map_err(io(&self.path))?;
        self.len += buf.len() as u64;
        Ok(buf.len() as u64)
    }
}

/// Write `image` as the snapshot of `generation`, start that generation's log and delete
/// the previous one (module docs: compaction). Returns the new log and the snapshot's size.
pub fn compact(
    dir: &Path,
    generation: u64,
    image: &Image,
    clock: &StateClock,
) -> Result<(Log, u64), StoreError> {
    let tmp = dir.join("snapshot.tmp");
    let mut buf = BytesMut::with_capacity(64 * 1024);
    buf.extend_from_slice(&SNAPSHOT_MAGIC);
    buf.extend_from_slice(&generation.to_le_bytes());
    let mut seq = 0;
    encode_frame(&mut buf, seq, &clock.clock_record());
    seq += 1;
    let mut file = File::create(&tmp).map_err(io(&tmp))?;
    let mut written = 0u64;
    let mut failed = None;
    image.to_records(|r| {
        if failed.is_some() {
            return;
        }
        encode_frame(&mut buf, seq, &r);
        seq += 1;
        if buf.len() >= 1 << 20 {
            written += buf.len() as u64;
            if let Err(e) = file.write_all(&buf) {
                failed = Some(e);
            }
            buf.clear();
        }
    });
    if let Some(e) = failed {
        return Err(io(&tmp)(e));
    }
    written += buf.len() as u64;
    file.write_all(&buf).map_err(io(&tmp))?;
    file.sync_all().map_err(io(&tmp))?;
    drop(file);
    std::fs::rename(&tmp, dir.join(SNAPSHOT)).map_err(io(&tmp))?;
    sync_dir(dir)?;
    let path = dir.join(log_name(generation));
    let mut file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&path)
        .map_err(io(&path))?;
    let mut h = Vec::with_capacity(HEADER_LEN);
    h.extend_from_slice(&LOG_MAGIC);
    h.extend_from_slice(&generation.to_le_bytes());
    file.write_all(&h).map_err(io(&path))?;
    file.sync_all().map_err(io(&path))?;
    sync_dir(dir)?;
    if generation > 0 {
        let _ = std::fs::remove_file(dir.join(log_name(generation - 1)));
    }
    Ok((
        Log {
            file,
            path,
            generation,
            len: HEADER_LEN as u64,
            seq: 0,
        },
        written,
    ))
}
