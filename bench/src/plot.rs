//! The soak's PNG: resident memory of each process (MB) and the store's size (MB) over time,
//! with the end of the first retention window (record retention plus tree margin) marked.
//! Labels use DejaVu Sans when the system has it (Debian's fonts-dejavu-core); without it the
//! lines are drawn unlabelled.

use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use crate::soak::Sample;

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

pub fn draw(path: &Path, samples: &[Sample], window: Duration) -> Result<()> {
    let labels = register_font();
    let root = BitMapBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let (top, bottom) = root.split_vertically(400);
    let end = samples.last().map_or(1.0, |s| s.at_s).max(1.0);
    let names: Vec<&str> = samples
        .first()
        .map(|s| s.rss_kb.iter().map(|(n, _)| *n).collect())
        .unwrap_or_default();
    let mut series: Vec<(String, Vec<(f64, f64)>)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let points = samples
                .iter()
                .map(|s| (s.at_s, s.rss_kb.get(i).map_or(0.0, |r| r.1 as f64 / 1024.0)))
                .collect();
            (format!("{n} RSS MB"), points)
        })
        .collect();
    panel(
        &top,
        "resident memory (MB)",
        &mut series,
        end,
        Some(window),
        labels,
    )?;
    let mut store = vec![(
        "store MB".to_string(),
        samples
            .iter()
            .map(|s| (s.at_s, s.store_bytes as f64 / 1e6))
            .collect(),
    )];
    panel(&bottom, "store (MB)", &mut store, end, Some(window), labels)?;
    root.present()
        .map_err(|e| anyhow!("write {}: {e}", path.display()))?;
    Ok(())
}

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
        mesh.x_desc("seconds").label_style(("sans-serif", 14));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(|e| anyhow!("{e}"))?;
    if let Some(window) = window.map(|w| w.as_secs_f64()).filter(|w| *w < end) {
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
