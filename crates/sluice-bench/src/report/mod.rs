//! Writing reports: JSON files ([`write_json`]), the Markdown pieces every report shares
//! ([`markdown`]) and charts ([`charts`]).

use std::io::Write as _;
use std::path::Path;

use anyhow::Context as _;
use serde::Serialize;

pub mod charts;
pub mod markdown;

/// Write a report as pretty JSON to `path` (creating parent directories).
pub fn write_json(report: &impl Serialize, path: &Path) -> anyhow::Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let mut file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    serde_json::to_writer_pretty(&mut file, report).context("serialising the report")?;
    file.write_all(b"\n").context("writing the report")?;
    Ok(())
}
