//! `sluice spool stat|verify|dump DIR`: the operator's offline view of a spool, run as the real
//! binary against a spool written by `sluice-spool` on a real directory.

use std::process::Command;

use sluice_spool::{Spool, SpoolConfig};

fn sluice(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .expect("run the sluice binary");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write_spool(dir: &std::path::Path, records: u32) {
    let (mut spool, _) = Spool::open(dir, SpoolConfig::default()).expect("open spool");
    for i in 0..records {
        spool
            .append(format!("device-{i} hello").as_bytes())
            .expect("append");
    }
    spool.commit().expect("commit");
}

#[test]
fn stat_verify_and_dump_describe_a_healthy_spool_without_changing_it() {
    let dir = tempfile::tempdir().unwrap();
    write_spool(dir.path(), 5);
    let before: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name(), std::fs::read(e.path()).unwrap_or_default())
        })
        .collect();
    let d = dir.path().to_str().unwrap();

    let (ok, out, err) = sluice(&["spool", "stat", d]);
    assert!(ok, "{err}");
    assert!(out.contains("segments       1"), "{out}");
    assert!(out.contains("oldest seq     1"), "{out}");
    assert!(out.contains("newest seq     5"), "{out}");

    let (ok, out, err) = sluice(&["spool", "verify", d]);
    assert!(ok, "{err}");
    assert!(out.contains("5 intact records, 0 damaged ranges"), "{out}");

    let (ok, out, err) = sluice(&["spool", "dump", d]);
    assert!(ok, "{err}");
    for i in 0..5 {
        assert!(out.contains(&format!("device-{i} hello")), "{out}");
    }

    let after: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name(), std::fs::read(e.path()).unwrap_or_default())
        })
        .collect();
    assert_eq!(before, after, "the tools are read-only");
}

#[test]
fn verify_names_a_damaged_record_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    write_spool(dir.path(), 5);
    let seg = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "seg"))
        .expect("a segment file");
    let mut bytes = std::fs::read(&seg).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(&seg, bytes).unwrap();

    let (ok, out, _) = sluice(&["spool", "verify", dir.path().to_str().unwrap()]);
    assert!(!ok, "damage makes verify fail");
    assert!(out.contains("1 damaged ranges"), "{out}");
    assert!(out.contains("damaged: "), "{out}");
}

#[test]
fn a_missing_directory_is_a_clear_error() {
    let (ok, _, err) = sluice(&["spool", "stat", "/nonexistent/sluice-spool"]);
    assert!(!ok);
    assert!(err.contains("/nonexistent/sluice-spool"), "{err}");
}
