//! PNG line charts of a sweep ("metric vs number of devices"), for the reports in docs/perf/.
//!
//! Owns: drawing one chart — one line with markers per system under test, the device count N
//! on a log₂ x axis labelled with plain N values, a linear or logarithmic y axis, a legend —
//! into a PNG file. Does not own: which figures are plotted (see [`crate::scenarios::seganet`]).
//!
//! Rendering: plotters' bitmap backend with text through `ab_glyph` and the DejaVu Sans font
//! embedded from the `dejavu` crate, so no system font, fontconfig or freetype is needed.
//! Points marked `hollow` are drawn as open circles (the scenario uses it for points where the
//! offered load was not achieved), the others as filled ones.
//!
//! Invariants: non-finite and (on a log axis) non-positive values are left out rather than
//! drawn; a chart with no drawable point is still a valid PNG with axes and a legend.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, Context as _};
use plotters::coord::Shift;
use plotters::prelude::*;

/// One line: a system under test.
#[derive(Debug, Clone)]
pub struct Series {
    pub label: String,
    pub points: Vec<ChartPoint>,
}

/// One measured point.
#[derive(Debug, Clone, Copy)]
pub struct ChartPoint {
    /// Number of devices (x), at least 1.
    pub n: f64,
    pub value: f64,
    /// Drawn as an open circle (e.g. the offered load was not achieved).
    pub hollow: bool,
}

/// A chart to draw.
#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub y_label: String,
    pub log_y: bool,
    /// A line of small print under the plot (e.g. what hollow markers mean).
    pub footnote: Option<String>,
    pub series: Vec<Series>,
}

/// Width and height of the PNG, pixels.
pub const SIZE: (u32, u32) = (960, 600);

/// Line colours, one per series in order (colour-blind-safe palette, Okabe–Ito).
const COLOURS: [RGBColor; 6] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
];

const FONT: &str = "sans-serif";

fn register_font() -> anyhow::Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
    });
    ok.then_some(())
        .ok_or_else(|| anyhow!("the embedded DejaVu Sans font could not be loaded"))
}

/// Draw `chart` into a PNG file at `path` (parent directory must exist).
pub fn write_png(chart: &Chart, path: &Path) -> anyhow::Result<()> {
    register_font()?;
    {
        let root = BitMapBackend::new(path, SIZE).into_drawing_area();
        draw(chart, &root).map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
        root.present()
            .map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
    }
    let len = std::fs::metadata(path)
        .with_context(|| format!("reading back {}", path.display()))?
        .len();
    if len == 0 {
        anyhow::bail!("{} is empty after drawing", path.display());
    }
    Ok(())
}

type DrawResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn draw(chart: &Chart, root: &DrawingArea<BitMapBackend<'_>, Shift>) -> DrawResult<()> {
    root.fill(&WHITE)?;
    let (area, foot) = match &chart.footnote {
        Some(_) => root.split_vertically(SIZE.1 - 28),
        None => (root.clone(), root.clone().shrink((0, 0), (0, 0))),
    };
    if let Some(text) = &chart.footnote {
        foot.draw_text(
            text,
            &(FONT, 15).into_font().color(&BLACK.mix(0.7)),
            (70, 4),
        )?;
    }
    let points: Vec<(f64, f64)> = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter(|p| drawable(p, chart.log_y))
        .map(|p| (p.n.log2(), p.value))
        .collect();
    let x_max = points.iter().map(|p| p.0).fold(4.0_f64, f64::max).ceil();
    let x_range = -0.4..x_max + 0.4;
    let y_max = points.iter().map(|p| p.1).fold(f64::MIN, f64::max);
    let y_min = points.iter().map(|p| p.1).fold(f64::MAX, f64::min);
    let mut builder = ChartBuilder::on(&area);
    builder
        .caption(&chart.title, (FONT, 24))
        .margin(14)
        .x_label_area_size(52)
        .y_label_area_size(78);
    let x_desc = "devices N (log scale)";
    let x_fmt = |x: &f64| {
        let n = 2f64.powf(*x);
        if (n - n.round()).abs() < 1e-6 && *x >= 0.0 {
            format!("{}", n.round())
        } else {
            String::new()
        }
    };
    let label_font = (FONT, 16);
    if chart.log_y {
        let (lo, hi) = if points.is_empty() {
            (0.1, 10.0)
        } else {
            (y_min / 1.6, y_max * 1.6)
        };
        let mut ctx = builder.build_cartesian_2d(x_range, (lo..hi).log_scale())?;
        ctx.configure_mesh()
            .x_labels(x_max as usize + 1)
            .x_label_formatter(&x_fmt)
            .y_label_formatter(&|y| short_number(*y))
            .x_desc(x_desc)
            .y_desc(&chart.y_label)
            .label_style(label_font)
            .axis_desc_style((FONT, 18))
            .light_line_style(WHITE.mix(0.0))
            .draw()?;
        draw_series(&mut ctx, chart)?;
        legend(&mut ctx)?;
    } else {
        let hi = if points.is_empty() {
            1.0
        } else {
            (y_max * 1.12).max(1e-9)
        };
        let mut ctx = builder.build_cartesian_2d(x_range, 0.0..hi)?;
        ctx.configure_mesh()
            .x_labels(x_max as usize + 1)
            .x_label_formatter(&x_fmt)
            .y_label_formatter(&|y| short_number(*y))
            .x_desc(x_desc)
            .y_desc(&chart.y_label)
            .label_style(label_font)
            .axis_desc_style((FONT, 18))
            .light_line_style(WHITE.mix(0.0))
            .draw()?;
        draw_series(&mut ctx, chart)?;
        legend(&mut ctx)?;
    }
    Ok(())
}

fn drawable(p: &ChartPoint, log_y: bool) -> bool {
    p.n >= 1.0 && p.value.is_finite() && (!log_y || p.value > 0.0)
}

fn draw_series<'a, Y>(
    ctx: &mut ChartContext<
        'a,
        BitMapBackend<'a>,
        Cartesian2d<plotters::coord::types::RangedCoordf64, Y>,
    >,
    chart: &Chart,
) -> DrawResult<()>
where
    Y: Ranged<ValueType = f64>,
{
    for (i, series) in chart.series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let pts: Vec<ChartPoint> = series
            .points
            .iter()
            .copied()
            .filter(|p| drawable(p, chart.log_y))
            .collect();
        let line = pts.iter().map(|p| (p.n.log2(), p.value));
        ctx.draw_series(LineSeries::new(line, colour.stroke_width(3)))?
            .label(series.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], colour.stroke_width(3))
            });
        ctx.draw_series(pts.iter().map(|p| {
            let style = if p.hollow {
                colour.stroke_width(2)
            } else {
                colour.filled()
            };
            Circle::new((p.n.log2(), p.value), 6, style)
        }))?;
    }
    Ok(())
}

fn legend<'a, Y>(
    ctx: &mut ChartContext<
        'a,
        BitMapBackend<'a>,
        Cartesian2d<plotters::coord::types::RangedCoordf64, Y>,
    >,
) -> DrawResult<()>
where
    Y: Ranged<ValueType = f64>,
{
    ctx.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font((FONT, 17))
        .draw()?;
    Ok(())
}

/// Tick label: at most 3 significant digits, no trailing zeros.
fn short_number(y: f64) -> String {
    if y == 0.0 {
        return "0".to_string();
    }
    let digits = (2 - y.abs().log10().floor() as i32).max(0) as usize;
    let s = format!("{y:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::short_number;

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(short_number(0.0), "0");
        assert_eq!(short_number(0.25), "0.25");
        assert_eq!(short_number(1.0), "1");
        assert_eq!(short_number(12.5), "12.5");
        assert_eq!(short_number(1000.0), "1000");
    }
}
