//! The `sluice` binary the scenario tests run. `cargo test` does not promise to build other
//! packages' binaries before a test runs, so both ways here run `cargo build -p sluice` when
//! they need to. A test target uses one of them, hence the `dead_code` allowances.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The sluice binary of this work tree, built now so that it has the code under test.
#[allow(dead_code)] // not every test target uses it
pub fn built_now() -> PathBuf {
    let root = workspace_root();
    let status = std::process::Command::new(env!("CARGO"))
        .args(["build", "-q", "-p", "sluice", "--bin", "sluice"])
        .current_dir(&root)
        .status()
        .expect("running cargo build -p sluice");
    assert!(status.success(), "cargo build -p sluice failed");
    target_dir(&root).join("debug/sluice")
}

/// The sluice binary of this workspace: `target/{debug,release}/sluice`, built with
/// `cargo build -p sluice` when neither exists (looked up once per test process).
#[allow(dead_code)] // not every test target uses it
pub fn debug_or_release() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let root = workspace_root();
        let target = target_dir(&root);
        let debug = target.join("debug/sluice");
        let release = target.join("release/sluice");
        if !debug.is_file() && !release.is_file() {
            let status = std::process::Command::new(env!("CARGO"))
                .args(["build", "-p", "sluice", "--bin", "sluice"])
                .current_dir(&root)
                .status()
                .expect("running cargo build -p sluice");
            assert!(status.success(), "cargo build -p sluice failed");
        }
        if debug.is_file() {
            debug
        } else {
            release
        }
    })
    .clone()
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `$CARGO_TARGET_DIR`, else the workspace's `target`.
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
}
