//! PNG charts of benchmark reports: one horizontal bar per row, its length the ratio (how many
//! times better hotstart did than the peer, on a log scale), green where the row meets its
//! target, red where it misses it, grey where it has none; each target is a black tick on its
//! bar's line, and a thin grey line marks parity (1×).
//!
//! Text needs a font: DejaVu Sans from Debian's `fonts-dejavu-core` (scripts/setup.sh installs
//! it), or any TrueType file named by `HOTSTART_CHART_FONT`.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Context, anyhow};
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::report::Report;

const FONT_FILES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// Registers the chart font once; an error says where a font was looked for.
fn font() -> anyhow::Result<()> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let from_env = std::env::var("HOTSTART_CHART_FONT").ok();
            let candidates: Vec<&str> = from_env.iter().map(String::as_str).chain(FONT_FILES.iter().copied()).collect();
            let Some((path, bytes)) = candidates
                .iter()
                .find_map(|p| std::fs::read(p).ok().map(|b| (p, b)))
            else {
                return Err(format!(
                    "no font for chart text: tried {} (install Debian's fonts-dejavu-core, or set HOTSTART_CHART_FONT)",
                    candidates.join(", ")
                ));
            };
            // Fonts stay registered for the life of the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{path} is not a font plotters can read"))
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// Draws `report` as a bar chart into the PNG file `path`.
pub fn draw(report: &Report, path: &Path) -> anyhow::Result<()> {
    font()?;
    let rows: Vec<_> = report
        .rows
        .iter()
        .filter(|r| r.ratio().is_finite() && r.ratio() > 0.0)
        .collect();
    anyhow::ensure!(!rows.is_empty(), "{}: no rows to chart", report.title);
    let labels: Vec<String> = rows
        .iter()
        .map(|r| format!("vs {} ({})", r.peer, r.what))
        .collect();
    let ratios: Vec<f64> = rows.iter().map(|r| r.ratio()).collect();
    let lo = ratios
        .iter()
        .chain(rows.iter().filter_map(|r| r.target.as_ref()))
        .fold(1.0f64, |a, &b| a.min(b))
        / 1.5;
    let hi = ratios
        .iter()
        .chain(rows.iter().filter_map(|r| r.target.as_ref()))
        .fold(1.0f64, |a, &b| a.max(b))
        * 1.5;
    let n = rows.len();
    let longest = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0) as u32;
    let label_width = (longest * 8 + 20).clamp(200, 900);
    let height = 140 + 34 * n as u32;
    let root = BitMapBackend::new(path, (label_width + 800, height)).into_drawing_area();
    let draw_err = |e: DrawingAreaErrorKind<_>| anyhow!("drawing {}: {e:?}", path.display());
    root.fill(&WHITE).map_err(draw_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(&report.title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(label_width)
        // Segments 0..=n - 1, one per row.
        .build_cartesian_2d((lo..hi).log_scale(), (0..n - 1).into_segmented())
        .map_err(draw_err)?;
    // Row i is drawn top to bottom: in segment n - 1 - i.
    let seg = |i: usize| n - 1 - i;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc(
            "times better than the peer (log scale; right of the grey line: hotstart is faster)",
        )
        .x_label_formatter(&|x| format!("{x:.2}×"))
        .y_labels(n)
        .y_label_formatter(&|y| match y {
            SegmentValue::CenterOf(k) if *k < n => labels[n - 1 - k].clone(),
            _ => String::new(),
        })
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(draw_err)?;
    chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| {
            let colour = match r.met() {
                Some(true) => RGBColor(46, 160, 67),
                Some(false) => RGBColor(207, 34, 46),
                None => RGBColor(140, 140, 140),
            };
            let mut bar = Rectangle::new(
                [
                    (lo, SegmentValue::Exact(seg(i) + 1)),
                    (r.ratio(), SegmentValue::Exact(seg(i))),
                ],
                colour.filled(),
            );
            bar.set_margin(6, 6, 0, 0);
            bar
        }))
        .map_err(draw_err)?;
    chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| {
            Text::new(
                format!("{:.2}×", r.ratio()),
                (r.ratio() * 1.03, SegmentValue::CenterOf(seg(i))),
                ("sans-serif", 14),
            )
        }))
        .map_err(draw_err)?;
    chart
        .draw_series(rows.iter().enumerate().filter_map(|(i, r)| {
            r.target.map(|t| {
                PathElement::new(
                    vec![
                        (t, SegmentValue::Exact(seg(i))),
                        (t, SegmentValue::Exact(seg(i) + 1)),
                    ],
                    BLACK.stroke_width(3),
                )
            })
        }))
        .map_err(draw_err)?;
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(1.0, SegmentValue::Exact(0)), (1.0, SegmentValue::Last)],
            RGBColor(90, 90, 90).stroke_width(1),
        )))
        .map_err(draw_err)?;
    root.present()
        .with_context(|| format!("write {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::report::Row;

    #[test]
    fn draws_a_png_with_every_row() {
        // scripts/setup.sh installs the font.
        font().unwrap();
        let d = Duration::from_millis;
        let mut report = Report::new("chart test");
        report.add(Row::rate(
            "read 1 GiB",
            1 << 30,
            d(500),
            "single GET",
            d(900),
            Some(0.95),
        ));
        report.add(Row::time(
            "start",
            d(300),
            "pip install",
            d(9000),
            Some(5.0),
        ));
        report.add(Row::rate("write", 1 << 30, d(900), "s3fs", d(500), None));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.png");
        draw(&report, &path).unwrap();
        let png = std::fs::read(&path).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG file");
        assert!(
            png.len() > 5_000,
            "with something drawn: {} bytes",
            png.len()
        );
        // One row is a chart too.
        report.rows.truncate(1);
        draw(&report, &path).unwrap();
        assert_eq!(&std::fs::read(&path).unwrap()[..4], b"\x89PNG");
    }
}
