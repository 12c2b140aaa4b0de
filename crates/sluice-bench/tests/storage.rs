//! The storage study at a tiny scale: the real `sluice-bench storage` binary and its library
//! entry append 5000 records with 1 and 2 threads to the spool and to SQLite in a temp dir,
//! read everything back, and write the reports. No timing is asserted: only that every
//! record came back with the right checksum and that the reports are there.

use std::process::Command;

use sluice_bench::scenarios::storage::{
    run_storage, write_reports, Durability, Engine, PointStatus, ReportFiles, StorageConfig,
};

fn tiny_config(dir: &std::path::Path, durability: Durability) -> StorageConfig {
    let mut config = StorageConfig::new(dir.to_path_buf());
    config.records = vec![5000];
    config.threads = vec![1, 2];
    config.engines = vec![Engine::Spool, Engine::Sqlite];
    config.durability = durability;
    config.commit_interval = std::time::Duration::from_millis(10);
    config.baseline_bytes = 1 << 20;
    config
}

#[test]
fn every_record_is_read_back_from_spool_and_sqlite_with_commits_that_never_fsync() {
    let dir = tempfile::tempdir().unwrap();
    let report = run_storage(&tiny_config(dir.path(), Durability::Never)).unwrap();
    assert_eq!(report.points.len(), 4, "2 engines × 1 N × 2 thread counts");
    for p in &report.points {
        assert_eq!(p.status, PointStatus::Measured, "{p:?}");
        assert_eq!(p.appended, 5000, "{p:?}");
        assert_eq!(p.read_back.records, 5000, "{p:?}");
        assert_eq!(p.read_back, p.expected, "{p:?}");
        assert!(p.verified);
        assert!(p.commits >= 1, "{p:?}");
        assert!(p.bytes_on_disk >= 5000 * 256, "{p:?}");
    }
    assert_eq!(report.headline.len(), 2, "spool vs SQLite at T=1 and T=2");
    assert_eq!(report.postgres, "not requested");
    // The point directories are removed; only the run directory's parent remains.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn group_commit_run_writes_json_markdown_and_charts() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let report = run_storage(&tiny_config(
        dir.path(),
        Durability::Interval(std::time::Duration::from_millis(10)),
    ))
    .unwrap();
    assert!(
        report.points.iter().all(|p| p.verified),
        "{:?}",
        report.points
    );
    let files = ReportFiles {
        json: Some(out.path().join("storage.json")),
        markdown: Some(out.path().join("storage.md")),
        charts: Some(out.path().join("storage")),
    };
    let md = write_reports(&report, &files).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("storage.json")).unwrap())
            .unwrap();
    assert_eq!(json["points"].as_array().unwrap().len(), 4);
    assert_eq!(json["points"][0]["verified"], true);
    assert!(md.contains("| spool | 5K | 1 |"), "{md}");
    assert!(md.contains("| sqlite | 5K | 2 |"), "{md}");
    assert!(md.contains("Spool append vs SQLite"), "{md}");
    assert_eq!(
        std::fs::read_to_string(out.path().join("storage.md")).unwrap(),
        md
    );
    for chart in ["storage-append.png", "storage-read.png"] {
        let bytes = std::fs::read(out.path().join(chart)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{chart} is not a PNG");
    }
}

#[test]
fn the_binary_runs_the_study_and_writes_its_reports() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let json_path = out.path().join("s.json");
    let md_path = out.path().join("s.md");
    let status = Command::new(env!("CARGO_BIN_EXE_sluice-bench"))
        .args([
            "storage",
            "--records",
            "5000",
            "--threads",
            "1,2",
            "--engines",
            "spool,sqlite",
        ])
        .args(["--durability", "never", "--baseline", "1MiB", "--dir"])
        .arg(dir.path())
        .arg("--out")
        .arg(&json_path)
        .arg("--md")
        .arg(&md_path)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let points = json["points"].as_array().unwrap();
    assert_eq!(points.len(), 4);
    for p in points {
        assert_eq!(p["verified"], true, "{p}");
        assert_eq!(p["read_back"]["records"], 5000, "{p}");
    }
    assert!(
        out.path().join("s-append.png").exists(),
        "charts default to --out without extension"
    );
    let md = std::fs::read_to_string(&md_path).unwrap();
    assert!(md.contains("## The storage-study table"), "{md}");
    assert!(
        md.contains("## Plain writes on the same file system"),
        "{md}"
    );
    assert!(json["baseline"]["new_file_mib_per_s"].as_f64().unwrap() > 0.0);
    assert!(String::from_utf8_lossy(&status.stdout).contains("| engine | N | threads |"));
}

#[test]
fn recovery_of_a_small_spool_is_timed_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = tiny_config(
        dir.path(),
        Durability::Interval(std::time::Duration::from_millis(10)),
    );
    config.study = false;
    config.recovery_bytes = Some(4 << 20);
    config.drop_caches = false; // a test must not disturb the machine's page cache
    let report = run_storage(&config).unwrap();
    assert!(report.points.is_empty());
    let r = report.recovery.clone().expect("recovery measured");
    let frames = (4u64 << 20) / (256 + 16);
    assert_eq!(r.records_written, frames);
    assert_eq!(r.cold.records_found, frames);
    assert!(r.cold.clean && r.warm.clean);
    assert_eq!(r.warm.records_found, frames);
    assert!(markdown_has_recovery(&report));
}

fn markdown_has_recovery(report: &sluice_bench::scenarios::storage::StorageReport) -> bool {
    sluice_bench::scenarios::storage::markdown(report).contains("## Recovery time of a")
}
