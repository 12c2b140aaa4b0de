//! The SQL engines of the storage study: T producer threads hand batches of records over a
//! bounded channel to one writer connection, which groups them into one transaction per
//! commit window (or per batch under `always`); then one thread scans the table back.
//!
//! SQLite: bundled through `rusqlite`, `journal_mode=WAL`, `synchronous=FULL` (each commit
//! fsyncs the WAL: durable per group commit) or `OFF` for `never`; one table
//! `records(id INTEGER PRIMARY KEY, body BLOB NOT NULL)`, one prepared `INSERT` per record.
//! PostgreSQL: a table `records(id bigserial PRIMARY KEY, body bytea NOT NULL)`,
//! `synchronous_commit` on (`off` for `never`), one `INSERT .. SELECT unnest($1::bytea[])` per
//! producer batch.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};

use super::postgres::Cluster;
use super::{dir_bytes, Durability, EngineRun, Point, RecordGen, Tally};

/// A writer connection driven by [`write_all`].
trait Writer {
    fn begin(&mut self) -> anyhow::Result<()>;
    /// Inserts the records in `records` (back to back, `record_bytes` each).
    fn insert(&mut self, records: &[u8], record_bytes: usize) -> anyhow::Result<()>;
    fn commit(&mut self) -> anyhow::Result<()>;
}

/// Batches in the channel between the producers and the writer, per producer.
const QUEUED_BATCHES_PER_PRODUCER: usize = 4;

/// Runs the producers and drives `writer` on this thread until every record is committed.
/// Returns the records appended per thread, the time until the last commit returned, and the
/// number of commits.
fn write_all(point: &Point, writer: &mut dyn Writer) -> anyhow::Result<(Vec<u64>, Duration, u64)> {
    let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(QUEUED_BATCHES_PER_PRODUCER * point.threads);
    let start = Instant::now();
    let window = point.window();
    let mut commits = 0u64;
    let appended = std::thread::scope(|scope| -> anyhow::Result<Vec<u64>> {
        let producers: Vec<_> = (0..point.threads)
            .map(|t| {
                let tx = tx.clone();
                let (count, rb, batch, deadline) = (
                    point.share(t),
                    point.record_bytes,
                    point.batch as u64,
                    point.deadline,
                );
                scope.spawn(move || {
                    let mut gen = RecordGen::new(t, rb);
                    let mut i = 0u64;
                    while i < count && Instant::now() < deadline {
                        let end = (i + batch).min(count);
                        let mut buf = Vec::with_capacity((end - i) as usize * rb);
                        for k in i..end {
                            buf.extend_from_slice(gen.body(k));
                        }
                        if tx.send(buf).is_err() {
                            break;
                        }
                        i = end;
                    }
                    i
                })
            })
            .collect();
        drop(tx);
        let result = (|| -> anyhow::Result<()> {
            let mut open = false;
            let mut next_commit = Instant::now() + window.unwrap_or_default();
            loop {
                let msg = match window {
                    Some(_) => {
                        rx.recv_timeout(next_commit.saturating_duration_since(Instant::now()))
                    }
                    None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                };
                match msg {
                    Ok(buf) => {
                        if !open {
                            writer.begin()?;
                            open = true;
                        }
                        writer.insert(&buf, point.record_bytes)?;
                        if window.is_none() {
                            writer.commit()?;
                            commits += 1;
                            open = false;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break,
                }
                if let Some(w) = window {
                    let now = Instant::now();
                    if now >= next_commit {
                        if open {
                            writer.commit()?;
                            commits += 1;
                            open = false;
                        }
                        next_commit = now + w;
                    }
                }
            }
            if open {
                writer.commit()?;
                commits += 1;
            }
            Ok(())
        })();
        // On a writer error the receiver goes away with `rx` below; producers then stop.
        drop(rx);
        let appended = producers
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow!("a producer thread panicked")))
            .collect::<anyhow::Result<Vec<u64>>>()?;
        result?;
        Ok(appended)
    })?;
    Ok((appended, start.elapsed(), commits))
}

struct Sqlite {
    conn: rusqlite::Connection,
}

impl Writer for Sqlite {
    fn begin(&mut self) -> anyhow::Result<()> {
        self.conn.execute_batch("BEGIN").context("SQLite BEGIN")
    }
    fn insert(&mut self, records: &[u8], record_bytes: usize) -> anyhow::Result<()> {
        let mut st = self
            .conn
            .prepare("INSERT INTO records(body) VALUES (?1)")
            .context("SQLite prepare")?;
        for body in records.chunks(record_bytes) {
            st.execute([body]).context("SQLite INSERT")?;
        }
        Ok(())
    }
    fn commit(&mut self) -> anyhow::Result<()> {
        self.conn.execute_batch("COMMIT").context("SQLite COMMIT")
    }
}

/// One point on SQLite (database `point.dir/storage.db`).
pub fn run_sqlite(point: &Point) -> anyhow::Result<EngineRun> {
    let path = point.dir.join("storage.db");
    let conn =
        rusqlite::Connection::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .context("setting WAL mode")?;
    if !mode.eq_ignore_ascii_case("wal") {
        bail!("SQLite refused WAL mode (journal_mode is {mode})");
    }
    let sync = if point.durability == Durability::Never {
        "OFF"
    } else {
        "FULL"
    };
    conn.execute_batch(&format!(
        "PRAGMA synchronous={sync}; CREATE TABLE records (id INTEGER PRIMARY KEY, body BLOB NOT NULL);"
    ))
    .context("creating the SQLite table")?;
    let mut w = Sqlite { conn };
    let (appended, append_time, commits) = write_all(point, &mut w)?;
    let bytes_on_disk = dir_bytes(&point.dir);
    let start = Instant::now();
    let mut read_back = Tally::default();
    {
        let mut st = w
            .conn
            .prepare("SELECT body FROM records ORDER BY id")
            .context("SQLite prepare SELECT")?;
        let mut rows = st.query([]).context("SQLite SELECT")?;
        while let Some(row) = rows.next().context("SQLite SELECT")? {
            read_back.add(row.get_ref(0)?.as_blob()?);
        }
    }
    let read_time = start.elapsed();
    Ok(EngineRun {
        appended,
        append_time,
        read_time,
        read_back,
        commits,
        bytes_on_disk,
        bytes_note: "database, -wal and -shm files after the appends",
        fsync_time: None,
    })
}

struct Postgres {
    client: postgres::Client,
    insert: postgres::Statement,
}

impl Writer for Postgres {
    fn begin(&mut self) -> anyhow::Result<()> {
        self.client
            .batch_execute("BEGIN")
            .context("PostgreSQL BEGIN")
    }
    fn insert(&mut self, records: &[u8], record_bytes: usize) -> anyhow::Result<()> {
        let bodies: Vec<&[u8]> = records.chunks(record_bytes).collect();
        self.client
            .execute(&self.insert, &[&bodies])
            .context("PostgreSQL INSERT")?;
        Ok(())
    }
    fn commit(&mut self) -> anyhow::Result<()> {
        self.client
            .batch_execute("COMMIT")
            .context("PostgreSQL COMMIT")
    }
}

/// One point on the PostgreSQL `cluster` (a fresh `records` table).
pub fn run_postgres(point: &Point, cluster: &Cluster) -> anyhow::Result<EngineRun> {
    let mut client = cluster.connect()?;
    let sync = if point.durability == Durability::Never {
        "off"
    } else {
        "on"
    };
    client
        .batch_execute(&format!(
            "SET synchronous_commit = {sync}; DROP TABLE IF EXISTS records; \
             CREATE TABLE records (id bigserial PRIMARY KEY, body bytea NOT NULL);"
        ))
        .context("creating the PostgreSQL table")?;
    let insert = client
        .prepare("INSERT INTO records(body) SELECT unnest($1::bytea[])")
        .context("PostgreSQL prepare INSERT")?;
    let mut w = Postgres { client, insert };
    let (appended, append_time, commits) = write_all(point, &mut w)?;
    let mut client = w.client;
    let bytes_on_disk: i64 = client
        .query_one("SELECT pg_total_relation_size('records')", &[])
        .context("PostgreSQL table size")?
        .get(0);
    let start = Instant::now();
    let mut read_back = Tally::default();
    {
        use postgres::fallible_iterator::FallibleIterator as _;
        let mut rows = client
            .query_raw(
                "SELECT body FROM records ORDER BY id",
                std::iter::empty::<&dyn postgres::types::ToSql>(),
            )
            .context("PostgreSQL SELECT")?;
        while let Some(row) = rows.next().context("PostgreSQL SELECT")? {
            let body: &[u8] = row.try_get(0).context("PostgreSQL body")?;
            read_back.add(body);
        }
    }
    let read_time = start.elapsed();
    client
        .batch_execute("DROP TABLE records")
        .context("dropping the PostgreSQL table")?;
    Ok(EngineRun {
        appended,
        append_time,
        read_time,
        read_back,
        commits,
        bytes_on_disk: u64::try_from(bytes_on_disk).unwrap_or(0),
        bytes_note: "table and primary-key index (pg_total_relation_size; WAL not counted)",
        fsync_time: None,
    })
}
