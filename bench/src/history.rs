//! `turnstile-bench history --in docs/bench-history.jsonl --png docs/bench-history.png`.
//!
//! Why this exists: the run history of every benchmark used to be a dated diary in the README.
//! It now lives in `docs/bench-history.jsonl`, one measurement a line (the schema is at the top
//! of `docs/benchmarks.md`), so that it can be checked and drawn rather than only read. This
//! module parses that file, refuses any line off the schema (naming its line number), and
//! draws the `lanes` figures over the runs: hand-off and completion p50, and both over the
//! JetStream floor beside their targets (2x, 4x). The unit test runs it on the committed file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, ensure, Context, Result};
use chrono::NaiveDate;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

/// What a line measured: a `turnstile-bench` command, side-by-side pairs of builds, or a probe
/// (temporary instrumentation, a profile or a wire trace, not a command of the bench).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Benchmark {
    Lanes,
    LanesPairs,
    Floor,
    Failover,
    Schedules,
    Scale,
    Soak,
    Probe,
}

/// One measurement: a run or a series of runs of one build on one machine.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub date: NaiveDate,
    pub machine: String,
    pub build: String,
    pub benchmark: Benchmark,
    pub deployment: String,
    /// How many runs the figures summarise; null when the history did not say.
    pub runs: Option<u32>,
    pub figures: BTreeMap<String, Figure>,
    /// How the figures stood against the benchmark's target, as the history put it.
    #[serde(default)]
    pub target: Option<String>,
    /// Everything the figures do not hold (may be empty, never absent).
    pub note: String,
}

/// A figure: one number, or the range over the runs (with their median when it was given).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum Figure {
    One(f64),
    Range(Range),
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Range {
    pub min: f64,
    pub max: f64,
    #[serde(default)]
    pub median: Option<f64>,
}

impl Figure {
    /// The number to draw: the value, the median, or the middle of the range.
    pub fn mid(self) -> f64 {
        match self {
            Figure::One(v) => v,
            Figure::Range(r) => r.median.unwrap_or((r.min + r.max) / 2.0),
        }
    }
}

/// Every line of a history file, checked against the schema; an error names the line.
pub fn parse(text: &str) -> Result<Vec<Entry>> {
    let mut entries: Vec<Entry> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let entry: Entry =
            serde_json::from_str(line).with_context(|| format!("line {n}: not an entry"))?;
        check(&entry).with_context(|| format!("line {n}"))?;
        if let Some(last) = entries.last() {
            ensure!(
                entry.date >= last.date,
                "line {n}: {} comes after {} (oldest first)",
                entry.date,
                last.date
            );
        }
        entries.push(entry);
    }
    ensure!(!entries.is_empty(), "no entries");
    Ok(entries)
}

fn check(e: &Entry) -> Result<()> {
    for (field, value) in [
        ("machine", &e.machine),
        ("build", &e.build),
        ("deployment", &e.deployment),
    ] {
        ensure!(!value.trim().is_empty(), "{field} is empty");
    }
    ensure!(e.runs != Some(0), "runs is 0");
    ensure!(
        e.target.as_deref().is_none_or(|t| !t.trim().is_empty()),
        "target is empty (leave it out)"
    );
    ensure!(e.note == e.note.trim(), "note has surrounding whitespace");
    ensure!(!e.figures.is_empty(), "no figures");
    for (name, figure) in &e.figures {
        let snake = name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        ensure!(
            snake && name.starts_with(|c: char| c.is_ascii_lowercase()),
            "figure name {name:?} is not snake_case"
        );
        if let Figure::Range(r) = figure {
            ensure!(r.min <= r.max, "{name}: min {} > max {}", r.min, r.max);
            if let Some(m) = r.median {
                ensure!(
                    (r.min..=r.max).contains(&m),
                    "{name}: median {m} outside {}-{}",
                    r.min,
                    r.max
                );
            }
        }
    }
    Ok(())
}

/// The `lanes` entries on one server: what the chart follows (other deployments differ by
/// design, and pairs and probes are smaller runs).
fn plotted(entries: &[Entry]) -> Vec<&Entry> {
    entries
        .iter()
        .filter(|e| e.benchmark == Benchmark::Lanes && e.deployment == "1 server")
        .collect()
}

/// Points (entry's index, figure) of the entries that have `name`.
fn series(entries: &[&Entry], name: &str) -> Vec<(f64, f64)> {
    entries
        .iter()
        .enumerate()
        .filter_map(|(i, e)| e.figures.get(name).map(|f| (i as f64, f.mid())))
        .collect()
}

/// The history's PNG: above, hand-off and completion p50 (µs); below, each over the floor of
/// its run with the targets drawn flat. One x step per `lanes` entry, oldest first.
pub fn draw(entries: &[Entry], path: &Path) -> Result<()> {
    let lanes = plotted(entries);
    ensure!(lanes.len() >= 2, "fewer than two lanes entries to draw");
    let end = (lanes.len() - 1) as f64;
    let first = lanes.first().map(|e| e.date).unwrap_or_default();
    let last = lanes.last().map(|e| e.date).unwrap_or_default();
    let x_desc = format!("lanes entries, oldest first ({first} to {last}; middle of each range)");
    let labels = crate::plot::register_font();
    let root = BitMapBackend::new(path, (1400, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let (top, bottom) = root.split_vertically(450);
    let mut latency = vec![
        (
            "hand-off p50 µs".to_string(),
            series(&lanes, "handoff_p50_us"),
        ),
        (
            "completion to agent p50 µs".to_string(),
            series(&lanes, "completion_p50_us"),
        ),
        (
            "JetStream floor p50 µs".to_string(),
            series(&lanes, "floor_p50_us"),
        ),
    ];
    crate::plot::panel_over(
        &top,
        "lanes: p50 (µs)",
        &x_desc,
        &mut latency,
        end,
        None,
        labels,
    )?;
    let flat = |y: f64| vec![(0.0, y), (end, y)];
    let mut ratios = vec![
        (
            "hand-off / floor".to_string(),
            series(&lanes, "handoff_over_floor_p50"),
        ),
        (
            "completion / floor".to_string(),
            series(&lanes, "completion_over_floor_p50"),
        ),
        ("hand-off target 2x".to_string(), flat(2.0)),
        ("completion target 4x".to_string(), flat(4.0)),
    ];
    crate::plot::panel_over(
        &bottom,
        "lanes: p50 over the floor",
        &x_desc,
        &mut ratios,
        end,
        None,
        labels,
    )?;
    root.present()
        .map_err(|e| anyhow!("write {}: {e}", path.display()))?;
    Ok(())
}

/// The subcommand: checks the file, draws the PNG, prints how many entries of each benchmark.
pub fn run(args: &[String]) -> Result<()> {
    let mut input = PathBuf::from("docs/bench-history.jsonl");
    let mut png = PathBuf::from("bench-history.png");
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--in" => input = PathBuf::from(value?),
            "--png" => png = PathBuf::from(value?),
            other => bail!(
                "usage: turnstile-bench history [--in FILE.jsonl] [--png FILE.png] (not {other:?})"
            ),
        }
    }
    let text =
        std::fs::read_to_string(&input).with_context(|| format!("read {}", input.display()))?;
    let entries = parse(&text).with_context(|| input.display().to_string())?;
    draw(&entries, &png)?;
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for e in &entries {
        let name = serde_json::to_value(e.benchmark)?;
        *counts
            .entry(name.as_str().unwrap_or_default().to_string())
            .or_default() += 1;
    }
    let out = serde_json::json!({
        "entries": entries.len(),
        "by_benchmark": counts,
        "plotted_lanes_entries": plotted(&entries).len(),
        "png": png.display().to_string(),
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shipped history: every line on the schema, dates in order, every kind of benchmark
    /// present, and the chart drawn from it.
    #[test]
    fn the_committed_history_parses_and_draws() -> Result<()> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/bench-history.jsonl");
        let text = std::fs::read_to_string(&path)?;
        let entries = parse(&text)?;
        assert_eq!(entries.len(), text.lines().count());
        for kind in [
            Benchmark::Lanes,
            Benchmark::LanesPairs,
            Benchmark::Floor,
            Benchmark::Failover,
            Benchmark::Schedules,
            Benchmark::Scale,
            Benchmark::Soak,
            Benchmark::Probe,
        ] {
            assert!(entries.iter().any(|e| e.benchmark == kind), "no {kind:?}");
        }
        assert!(plotted(&entries).len() > 20);
        let dir = tempfile::tempdir()?;
        let png = dir.path().join("history.png");
        draw(&entries, &png)?;
        let bytes = std::fs::read(&png)?;
        assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
        Ok(())
    }

    #[test]
    fn a_line_off_the_schema_is_refused_with_its_number() {
        let good = r#"{"date":"2026-12-01","machine":"m","build":"b","benchmark":"lanes","deployment":"1 server","runs":3,"figures":{"floor_p50_us":{"min":1,"max":2}},"note":""}"#;
        assert!(parse(good).is_ok());
        for (bad, why) in [
            (good.replace("2026-12-01", "2026-13-01"), "a bad date"),
            (
                good.replace("\"lanes\"", "\"lane\""),
                "an unknown benchmark",
            ),
            (
                good.replace("\"note\":\"\"", "\"notes\":\"\""),
                "an unknown field",
            ),
            (good.replace("\"min\":1", "\"min\":3"), "min above max"),
            (good.replace("floor_p50_us", "Floor p50"), "a figure name"),
            (
                good.replace("{\"min\":1,\"max\":2}", "\"1-2\""),
                "a string figure",
            ),
            (good.replace("\"runs\":3", "\"runs\":0"), "no runs"),
            (
                good.replace("\"build\":\"b\"", "\"build\":\" \""),
                "an empty build",
            ),
        ] {
            let text = format!("{good}\n{bad}\n");
            let err = parse(&text).err().map(|e| format!("{e:#}"));
            assert!(
                err.as_deref().is_some_and(|e| e.starts_with("line 2")),
                "{why}: {err:?}"
            );
        }
        let older = good.replace("2026-12-01", "2026-11-30");
        assert!(parse(&format!("{good}\n{older}")).is_err(), "out of order");
    }
}
