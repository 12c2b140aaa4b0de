//! Inputs the fuzz targets crashed on, replayed through the same steps as the target (the
//! `spool_recovery` target's own file, `fuzz/fuzz_targets/shared/spool_recovery_steps.rs`):
//! each file in `tests/fuzz_inputs/` is a regression test that failed before its fix.

use std::path::Path;

#[path = "../../../fuzz/fuzz_targets/shared/spool_recovery_steps.rs"]
mod spool_recovery_steps;

#[test]
fn every_saved_fuzz_input_replays_cleanly() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_inputs");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("tests/fuzz_inputs") {
        let path = entry.expect("entry").path();
        if path
            .file_name()
            .is_some_and(|f| f.to_string_lossy().starts_with("spool_recovery-"))
        {
            spool_recovery_steps::run(&std::fs::read(&path).expect("read input"));
            n += 1;
        }
    }
    assert!(n > 0, "no saved input");
}
