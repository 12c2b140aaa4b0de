//! PNG charts of the storage study: records/s (log scale) against producer threads (log₂
//! scale), one line per engine and N — colour by engine, marker by N.
//!
//! Rendering as in [`crate::report::charts`]: plotters' bitmap backend, text through `ab_glyph` with
//! the DejaVu Sans font embedded from the `dejavu` crate. Points that were not measured in
//! full (skipped, failed, cut) are left out.

use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;

use super::{short_count, Engine, PointResult, PointStatus};

const FONT: &str = "storage-sans";
const SIZE: (u32, u32) = (1000, 640);

fn colour(e: Engine) -> RGBColor {
    match e {
        Engine::Spool => RGBColor(0, 114, 178),
        Engine::Sqlite => RGBColor(213, 94, 0),
        Engine::Postgres => RGBColor(0, 158, 115),
    }
}

/// Which figure a chart shows.
#[derive(Debug, Clone, Copy)]
pub enum Metric {
    Append,
    Read,
}

/// Draws `metric` for `points` into a PNG at `path`.
pub fn write_png(
    points: &[PointResult],
    metric: Metric,
    record_bytes: usize,
    durability: &str,
    path: &Path,
) -> anyhow::Result<()> {
    let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
    let value = |p: &PointResult| match metric {
        Metric::Append => p.append_records_per_s,
        Metric::Read => p.read_records_per_s,
    };
    let ok: Vec<&PointResult> = points
        .iter()
        .filter(|p| p.status == PointStatus::Measured && p.verified && value(p) > 0.0)
        .collect();
    let (lo, hi) = ok.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
        (lo.min(value(p)), hi.max(value(p)))
    });
    let (lo, hi) = if ok.is_empty() {
        (1.0, 10.0)
    } else {
        (lo / 2.0, hi * 2.0)
    };
    let x_max = ok
        .iter()
        .map(|p| (p.threads as f64).log2())
        .fold(1.0f64, f64::max)
        .ceil();
    let title = match metric {
        Metric::Append => {
            format!("append: records/s until durable ({record_bytes} B, {durability})")
        }
        Metric::Read => {
            format!("read back: records/s, one thread, sequential scan ({record_bytes} B)")
        }
    };
    let draw = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let root = BitMapBackend::new(path, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let mut ctx = ChartBuilder::on(&root)
            .caption(&title, (FONT, 20))
            .margin(14)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d(-0.3..x_max + 0.3, (lo..hi).log_scale())?;
        ctx.configure_mesh()
            .x_labels(x_max as usize + 1)
            .x_label_formatter(&|x| {
                let n = 2f64.powf(*x);
                if (n - n.round()).abs() < 1e-6 && *x >= 0.0 {
                    format!("{}", n.round())
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|y| super::fmt_rate(*y))
            .x_desc("producer threads T (log scale)")
            .y_desc("records/s (log scale)")
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 17))
            .light_line_style(WHITE.mix(0.0))
            .draw()?;
        let mut ns: Vec<u64> = ok.iter().map(|p| p.records).collect();
        ns.sort_unstable();
        ns.dedup();
        for engine in [Engine::Spool, Engine::Sqlite, Engine::Postgres] {
            for (k, &n) in ns.iter().enumerate() {
                let mut pts: Vec<(f64, f64)> = ok
                    .iter()
                    .filter(|p| p.engine == engine && p.records == n)
                    .map(|p| ((p.threads as f64).log2(), value(p)))
                    .collect();
                if pts.is_empty() {
                    continue;
                }
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                let c = colour(engine);
                let width = 1 + k as u32;
                ctx.draw_series(LineSeries::new(pts.clone(), c.stroke_width(width)))?
                    .label(format!("{} N={}", engine.name(), short_count(n)))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(width))
                    });
                let size = 3 + k as i32;
                match k % 3 {
                    0 => ctx.draw_series(pts.iter().map(|&p| Circle::new(p, size, c.filled())))?,
                    1 => ctx.draw_series(
                        pts.iter()
                            .map(|&p| TriangleMarker::new(p, size + 1, c.filled())),
                    )?,
                    _ => ctx
                        .draw_series(pts.iter().map(|&p| Cross::new(p, size, c.stroke_width(2))))?,
                };
            }
        }
        ctx.configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font((FONT, 14))
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow!("drawing {}: {e}", path.display()))
}
