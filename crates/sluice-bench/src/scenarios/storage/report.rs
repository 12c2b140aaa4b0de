//! The storage study's report: the Markdown tables, per-point lines and the JSON, Markdown and
//! PNG files.

use super::*;

pub(super) fn fmt_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_secs_f64() * 1e3)
    }
}

pub(super) fn status_text(p: &PointResult) -> String {
    match &p.status {
        PointStatus::Measured if p.verified => "ok".to_string(),
        PointStatus::Measured => "READ-BACK MISMATCH".to_string(),
        PointStatus::Cut => format!(
            "cut at {} of {} records{}",
            p.appended,
            p.records,
            if p.verified { "" } else { ", MISMATCH" }
        ),
        PointStatus::Skipped(why) => format!("skipped: {why}"),
        PointStatus::Failed(why) => format!("failed: {why}"),
    }
}

pub(super) fn commits_text(p: &PointResult) -> String {
    match p.fsync_s {
        Some(f) => format!("{} ({f:.2})", p.commits),
        None => p.commits.to_string(),
    }
}

/// One progress line.
pub fn summary_line(p: &PointResult) -> String {
    format!(
        "{} N={} T={}: append {:.0} rec/s ({:.3} s, {} commits), read {:.0} rec/s ({:.3} s), {:.1} MiB on disk; {}",
        p.engine.name(),
        p.records,
        p.threads,
        p.append_records_per_s,
        p.append_s,
        commits_text(p),
        p.read_records_per_s,
        p.read_s,
        p.bytes_on_disk as f64 / MIB,
        status_text(p)
    )
}

/// `5000` → `5K`, `5000000` → `5M`.
pub fn short_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}K", n / 1_000),
        n => n.to_string(),
    }
}

pub(super) fn fmt_rate(r: f64) -> String {
    if r <= 0.0 {
        "–".to_string()
    } else if r >= 1e6 {
        format!("{:.2} M", r / 1e6)
    } else if r >= 1e3 {
        format!("{:.1} K", r / 1e3)
    } else {
        format!("{r:.0}")
    }
}

/// The Markdown report.
pub fn markdown(r: &StorageReport) -> String {
    let m = &r.machine;
    let mut s = String::new();
    let _ = writeln!(s, "# Storage study: sluice spool vs SQLite vs PostgreSQL\n");
    let _ = writeln!(
        s,
        "- commit `{}`{}; started {}\n- machine: {} × {}, kernel {}\n- files: `{}` — {} on `{}` (mounted at `{}`)\n\
         - load average at start `{}`, at end `{}`\n- command: `{}`",
        m.commit,
        if m.worktree_dirty { " (work tree had uncommitted changes)" } else { "" },
        m.started_at,
        m.nproc,
        m.cpu_model,
        m.kernel,
        r.file_system.dir,
        r.file_system.fs_type,
        r.file_system.device,
        r.file_system.mount_point,
        m.loadavg_at_start,
        r.loadavg_at_end,
        m.command_line
    );
    let _ = writeln!(
        s,
        "- records of {} B; durability: {}; producer batch {} records; cap per point {:.0} s\n- PostgreSQL: {}\n",
        r.record_bytes, r.durability, r.batch, r.max_point_time_s, r.postgres
    );
    if !r.headline.is_empty() {
        let _ = writeln!(
            s,
            "## Spool append vs SQLite, {} B records, {}\n",
            r.record_bytes, r.durability
        );
        let _ = writeln!(
            s,
            "Target: spool ≥ 1M records/s and ≥ 20× SQLite in the same run.\n"
        );
        let _ = writeln!(
            s,
            "| threads | N | spool append rec/s | SQLite append rec/s | ratio | ≥ 1M/s | ≥ 20× |"
        );
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|:---:|:---:|");
        for h in &r.headline {
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {:.0} | {:.1}× | {} | {} |",
                h.threads,
                short_count(h.records),
                h.spool_append_records_per_s,
                h.sqlite_append_records_per_s,
                h.ratio,
                if h.meets_1m { "yes" } else { "no" },
                if h.meets_20x { "yes" } else { "no" }
            );
        }
        s.push('\n');
    }
    if !r.points.is_empty() {
        let _ = writeln!(s, "## The storage-study table\n");
        let _ = writeln!(
            s,
            "| engine | N | threads | append rec/s | read rec/s | append s | read s | total s | commits (fsync s) | on disk MiB | load after | result |"
        );
        let _ = writeln!(
            s,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
        );
        for p in &r.points {
            if p.ran() {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {} | {:.1} | {} | {} |",
                    p.engine.name(),
                    short_count(p.records),
                    p.threads,
                    fmt_rate(p.append_records_per_s),
                    fmt_rate(p.read_records_per_s),
                    p.append_s,
                    p.read_s,
                    p.total_s,
                    commits_text(p),
                    p.bytes_on_disk as f64 / MIB,
                    p.loadavg_after.split(' ').next().unwrap_or(""),
                    status_text(p)
                );
            } else {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | | | | | | | | | {} |",
                    p.engine.name(),
                    short_count(p.records),
                    p.threads,
                    status_text(p)
                );
            }
        }
        let notes: Vec<String> = {
            let mut v: Vec<String> = r
                .points
                .iter()
                .filter(|p| p.ran())
                .map(|p| format!("{}: {}", p.engine.name(), p.bytes_note))
                .collect();
            v.sort();
            v.dedup();
            v
        };
        let _ = writeln!(s, "\nOn disk: {}.\n", notes.join("; "));
    }
    if let Some(rec) = &r.recovery {
        let _ = writeln!(
            s,
            "## Recovery time of a {:.2} GiB spool\n",
            rec.spool_bytes as f64 / GIB
        );
        let _ = writeln!(
            s,
            "Written first: {} records of {} B in {:.2} s ({:.0} records/s, group commit). \
             Then `Spool::open` timed twice. Page cache dropped before the cold open: {}.\n",
            rec.records_written,
            rec.record_bytes,
            rec.write_s,
            rec.write_records_per_s,
            rec.drop_caches
        );
        let _ = writeln!(
            s,
            "| open | time s | segments | bytes scanned | records found | clean | skipped ranges |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|:---:|---:|");
        for (name, o) in [("cold", &rec.cold), ("warm", &rec.warm)] {
            let _ = writeln!(
                s,
                "| {name} | {:.3} | {} | {} | {} | {} | {} |",
                o.open_s,
                o.segments_scanned,
                o.bytes_scanned,
                o.records_found,
                o.clean,
                o.skipped_ranges
            );
        }
        let _ = writeln!(
            s,
            "\nFor scale: reading the same {:.2} GiB with plain sequential 1 MiB reads ({}) took {:.3} s \
             ({:.0} MiB/s).",
            rec.spool_bytes as f64 / GIB,
            if rec.plain_read_cold { "page cache dropped first" } else { "page cache as it was" },
            rec.plain_read_s,
            rec.spool_bytes as f64 / MIB / rec.plain_read_s.max(1e-9)
        );
        let _ = writeln!(
            s,
            "\nTarget < 2 s: cold {}, warm {}.\n",
            if rec.cold.open_s < 2.0 {
                "met"
            } else {
                "NOT met"
            },
            if rec.warm.open_s < 2.0 {
                "met"
            } else {
                "NOT met"
            }
        );
    }
    if let Some(b) = &r.baseline {
        let frame = (r.record_bytes + 16) as f64;
        let _ = writeln!(s, "## Plain writes on the same file system, for scale\n");
        let _ = writeln!(
            s,
            "`write(2)` of 1 MiB chunks, {} MiB in all: to a new file {:.0} MiB/s (≈ {:.2} M records/s \
             of {} B framed as {} B); overwriting the same cached file {:.0} MiB/s; to a new file plus \
             one fsync {:.0} MiB/s (≈ {:.2} M records/s).\n",
            b.bytes >> 20,
            b.new_file_mib_per_s,
            b.new_file_mib_per_s * MIB / frame / 1e6,
            r.record_bytes,
            frame,
            b.overwrite_mib_per_s,
            b.new_file_fsync_mib_per_s,
            b.new_file_fsync_mib_per_s * MIB / frame / 1e6
        );
    }
    let _ = writeln!(s, "## How to read it\n");
    let _ = writeln!(
        s,
        "- N is the total number of records of a point, split evenly over T producer threads. \
         *append rec/s* is N over the time from the first append to the return of the last commit \
         (every record durable under the policy above); *read rec/s* is one thread scanning \
         everything back in storage order, checksumming each body. *result* `ok` means the count \
         and an order-independent checksum of what was read equal those of what was appended.\n\
         - spool: one spool per producer thread (the gateway's one spool per shard), each with a \
         writer thread running its commit jobs (write + fsync) while appends go on; a commit \
         carries at most the spool's `max_batch_bytes`. SQLite: WAL, `synchronous=FULL`, one \
         writer connection fed by the producers over a bounded channel, one transaction per commit \
         window — the best SQLite can do, since it admits one writer at a time. PostgreSQL: \
         default server settings (`fsync=on`, `synchronous_commit=on`), one writer connection, \
         one `INSERT … SELECT unnest($1::bytea[])` per producer batch, one transaction per window.\n\
         - *commits* counts transactions (SQL) or commit jobs (spool, summed over spools; in \
         brackets the seconds its commit jobs spent in fsync, summed over spools). A commit \
         that takes longer than the window delays the next one, so slow storage shows as fewer, \
         larger commits rather than a missed window.\n\
         - Skipped points were predicted (from the same engine and T at a smaller N) to exceed \
         the per-point cap; *cut* points ran three times over it and stopped appending.\n\
         - Small points (5K records take a few milliseconds) measure mostly the latency of one or \
         two commits and thread start-up; the larger N, the more a figure says about throughput.\n"
    );
    let _ = writeln!(s, "## Caveats\n");
    let _ = writeln!(
        s,
        "- A shared machine: other work ran alongside (see the load averages per point and at \
         start and end); compare figures within one run, as ratios, rather than across runs.\n\
         - A virtual disk on a virtual machine: fsync latency and bandwidth are the host's, and \
         writing *new* page-cache pages costs far more than on bare metal (see \
         \"Plain writes\" above): appends of new data cannot outrun that figure, whatever the engine.\n\
         - Reads ran right after the appends, from the page cache; they measure the engines' read \
         paths, not the disk.\n\
         - Bytes on disk count different things per engine (see the line under the table).\n"
    );
    s
}

/// Where the report goes.
#[derive(Debug, Clone, Default)]
pub struct ReportFiles {
    pub json: Option<PathBuf>,
    pub markdown: Option<PathBuf>,
    /// Prefix of `{prefix}-append.png` and `{prefix}-read.png`.
    pub charts: Option<PathBuf>,
}

/// Writes the JSON, Markdown and charts named in `files` (each optional); returns the
/// Markdown.
pub fn write_reports(report: &StorageReport, files: &ReportFiles) -> anyhow::Result<String> {
    let md = markdown(report);
    if let Some(path) = &files.json {
        write_json(report, path)?;
        eprintln!("storage: JSON written to {}", path.display());
    }
    if let Some(path) = &files.markdown {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(path, &md).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("storage: Markdown written to {}", path.display());
    }
    if let Some(prefix) = files.charts.as_ref().filter(|_| !report.points.is_empty()) {
        for (metric, suffix) in [
            (chart::Metric::Append, "append"),
            (chart::Metric::Read, "read"),
        ] {
            let path = PathBuf::from(format!("{}-{suffix}.png", prefix.display()));
            chart::write_png(
                &report.points,
                metric,
                report.record_bytes,
                &report.durability,
                &path,
            )?;
            eprintln!("storage: chart written to {}", path.display());
        }
    }
    Ok(md)
}
