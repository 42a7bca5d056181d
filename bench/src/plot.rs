//! Line charts in PNGs, for the soak (`soak.rs` draws its memory and store over time), the
//! chaos campaign's timeline and the benchmark history (`history.rs`): one panel of series
//! against seconds (or another x axis), with a marked instant.
//! Labels use DejaVu Sans when the system has it (Debian's fonts-dejavu-core); without it the
//! lines are drawn unlabelled.

use std::time::Duration;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// One chart of line series against seconds, with a legend; `window`, when given and within
/// the chart, is marked by a vertical line. Shared with the chaos campaign's timeline.
pub(crate) fn panel(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    title: &str,
    series: &mut [(String, Vec<(f64, f64)>)],
    end: f64,
    window: Option<Duration>,
    labels: bool,
) -> Result<()> {
    let window = window.map(|w| w.as_secs_f64());
    panel_over(area, title, "seconds", series, end, window, labels)
}

/// [`panel`] with its x axis described by `x_desc` and the marked instant in x units.
pub(crate) fn panel_over(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    title: &str,
    x_desc: &str,
    series: &mut [(String, Vec<(f64, f64)>)],
    end: f64,
    window: Option<f64>,
    labels: bool,
) -> Result<()> {
    let top = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(_, y)| *y))
        .fold(1.0f64, f64::max)
        * 1.1;
    let mut builder = ChartBuilder::on(area);
    builder
        .margin(15)
        .x_label_area_size(30)
        .y_label_area_size(50);
    if labels {
        builder.caption(title, ("sans-serif", 20));
    }
    let mut chart = builder
        .build_cartesian_2d(0.0..end, 0.0..top)
        .map_err(|e| anyhow!("{e}"))?;
    let mut mesh = chart.configure_mesh();
    if labels {
        mesh.x_desc(x_desc).label_style(("sans-serif", 14));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(|e| anyhow!("{e}"))?;
    if let Some(window) = window.filter(|w| *w < end) {
        chart
            .draw_series(LineSeries::new(
                [(window, 0.0), (window, top)],
                BLACK.mix(0.3),
            ))
            .map_err(|e| anyhow!("{e}"))?;
    }
    for (i, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let drawn = chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| anyhow!("{e}"))?;
        if labels {
            drawn
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color));
        }
    }
    if labels {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
    }
    Ok(())
}

/// Registers the system's DejaVu Sans for labels; false when it is not installed.
pub(crate) fn register_font() -> bool {
    let Ok(bytes) = std::fs::read(FONT) else {
        return false;
    };
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
}
