//! Fuzz target for the config loader (crates/sluice/src/config: TOML → `Config`, then
//! `validate`).
//!
//! Feeds the input as the text of `sluice.toml` to `sluice::config::parse_unchecked_files`
//! (parse and every check except opening the files it names, so the target never touches the
//! disk). Checks, besides "no panic" (an error is an error, whatever the text): every config
//! that loads prints (`to_toml`) as text that loads again to an equal config; its warnings,
//! the function sinks it adds, the shard count (within `MAX_SHARDS`) and the per-shard
//! buffer bound can be computed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = config::parse_unchecked_files(text) else {
        return;
    };
    let printed = cfg.to_toml();
    match config::parse_unchecked_files(&printed) {
        Ok(again) => assert_eq!(again, cfg, "printed config loads differently:\n{printed}"),
        Err(e) => panic!("printed config does not load: {e}\n{printed}"),
    }
    let _ = cfg.warnings();
    // (`shard_count` with `shards = 0` asks the OS for the cores: not per input.)
    if cfg.gateway.shards != 0 {
        let shards = cfg.gateway.shard_count();
        assert!(shards <= sluice::config::GatewayConfig::MAX_SHARDS);
        let _ = cfg.gateway.max_buffered_per_shard(shards);
    }
    let with_sinks = cfg.clone().with_function_sinks();
    assert_eq!(
        with_sinks.clone().with_function_sinks(),
        with_sinks,
        "with_function_sinks is not idempotent"
    );
    assert_eq!(
        with_sinks.to_toml(),
        printed,
        "function sinks show in the file's view"
    );
});
