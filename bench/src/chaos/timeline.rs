//! The campaign's timeline as a PNG (`--png FILE`): above, the work done (turns completed and
//! steps ended, cumulative) against time; below, each fault as a bar from its injection for
//! as long as it was held, one row per kind. A stall shows as a flat stretch above a bar.

use std::path::Path;

use anyhow::{anyhow, Result};
use chrono::{DateTime, Utc};
use plotters::prelude::*;
use turnstile_shared::records::TurnState;

use super::history::History;
use super::inject::Injected;
use super::plan::FaultKind;

/// One row each, every kind the plan draws (`every_kind_the_plan_draws_has_a_row`).
const KINDS: [FaultKind; 9] = [
    FaultKind::KillService,
    FaultKind::PauseService,
    FaultKind::HostGone,
    FaultKind::KillAgent,
    FaultKind::KillTmux,
    FaultKind::KillNats,
    FaultKind::PauseNats,
    FaultKind::PartitionNats,
    FaultKind::DiskFull,
];

pub fn draw(
    path: &Path,
    started: DateTime<Utc>,
    history: &History,
    faults: &[Injected],
) -> Result<()> {
    let labels = crate::plot::register_font();
    let since = |t: DateTime<Utc>| (t - started).num_milliseconds() as f64 / 1000.0;
    let mut turns: Vec<f64> = history
        .turns
        .values()
        .filter_map(|t| match &t.state {
            TurnState::Completed { ended_at, .. } => Some(since(*ended_at)),
            _ => None,
        })
        .collect();
    let mut steps: Vec<f64> = history
        .executions
        .values()
        .filter_map(|e| e.status.ended_at().map(since))
        .collect();
    turns.sort_by(f64::total_cmp);
    steps.sort_by(f64::total_cmp);
    let end = turns
        .last()
        .copied()
        .into_iter()
        .chain(steps.last().copied())
        .chain(faults.iter().map(|f| f.at_s + f.hold_s))
        .fold(1.0f64, f64::max);
    let cumulative = |xs: &[f64]| -> Vec<(f64, f64)> {
        xs.iter()
            .enumerate()
            .map(|(i, x)| (x.max(0.0), (i + 1) as f64))
            .collect()
    };
    let root = BitMapBackend::new(path, (1400, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let (top, bottom) = root.split_vertically(480);
    let mut work = vec![
        ("turns completed".to_string(), cumulative(&turns)),
        ("steps ended".to_string(), cumulative(&steps)),
    ];
    crate::plot::panel(&top, "work done (cumulative)", &mut work, end, None, labels)?;
    let rows = KINDS.len() as f64;
    let mut faults_chart = ChartBuilder::on(&bottom)
        .margin(15)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..end, 0.0..rows)
        .map_err(|e| anyhow!("{e}"))?;
    let mut mesh = faults_chart.configure_mesh();
    mesh.y_labels(0).x_desc("seconds");
    if !labels {
        mesh.x_labels(0);
    }
    mesh.draw().map_err(|e| anyhow!("{e}"))?;
    if labels {
        // Each row's kind, written at the row's left end (axis labels fall between rows).
        for (row, kind) in KINDS.iter().enumerate() {
            faults_chart
                .draw_series(std::iter::once(Text::new(
                    kind.name().to_string(),
                    (end * 0.002, row as f64 + 0.95),
                    ("sans-serif", 13),
                )))
                .map_err(|e| anyhow!("{e}"))?;
        }
    }
    for f in faults.iter().filter(|f| f.skipped.is_none()) {
        let Some(row) = KINDS.iter().position(|k| k.name() == f.kind) else {
            continue;
        };
        let y = row as f64 + 0.2;
        let color = Palette99::pick(row + 2).to_rgba();
        let width = f.hold_s.max(end / 400.0);
        faults_chart
            .draw_series(std::iter::once(Rectangle::new(
                [(f.at_s, y), (f.at_s + width, y + 0.6)],
                color.filled(),
            )))
            .map_err(|e| anyhow!("{e}"))?;
    }
    root.present()
        .map_err(|e| anyhow!("write {}: {e}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kind without a row is silently left out of the picture (disk-full and partition
    /// faults once were).
    #[test]
    fn every_kind_the_plan_draws_has_a_row() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let targets = super::super::plan::Targets {
            services: names(&["lane-a", "broker-b1"]),
            transports: names(&["transport-h1"]),
            hosts: names(&["h1"]),
            nats_nodes: names(&["nats-0", "nats-1", "nats-2"]),
            stores: names(&["nats-0", "nats-1", "nats-2"]),
        };
        let plan = super::super::plan::draw(
            7,
            std::time::Duration::from_secs(3600),
            std::time::Duration::from_secs(6),
            &targets,
        );
        for f in &plan {
            assert!(KINDS.contains(&f.kind), "{:?} has no row", f.kind);
        }
        assert!(plan.len() > 100);
    }

    #[test]
    fn a_timeline_is_drawn_from_a_history_and_its_faults() {
        let started = Utc::now();
        let mut history = History::default();
        let turn = turnstile_shared::TurnId::new();
        history.turns.insert(
            turn.clone(),
            turnstile_shared::records::TurnRecord {
                id: turn,
                session: turnstile_shared::SessionId::new(),
                text: "t".into(),
                queued_at: started,
                delivery: None,
                parent: None,
                state: TurnState::Completed {
                    host: "h1".parse().expect("host"),
                    typed_at: started,
                    ended_at: started + chrono::Duration::seconds(3),
                    output: vec![],
                },
            },
        );
        let faults = vec![Injected {
            kind: FaultKind::PauseService.name(),
            target: "lane-a".into(),
            at_s: 1.0,
            hold_s: 2.5,
            recovery_ms: Some(120),
            skipped: None,
        }];
        let dir = tempfile::tempdir().expect("dir");
        let png = dir.path().join("timeline.png");
        draw(&png, started, &history, &faults).expect("draw");
        let bytes = std::fs::read(&png).expect("png");
        assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
    }
}
