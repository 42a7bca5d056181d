//! Figures from samples: percentiles, p50/p99/mean summaries and ratios between them. Apart
//! from `main.rs`, which runs the benchmarks, because every benchmark's file uses them.

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// p50/p99/mean of microsecond samples.
pub fn summary(mut samples: Vec<f64>) -> serde_json::Value {
    samples.sort_by(f64::total_cmp);
    let mean = samples.iter().sum::<f64>() / samples.len().max(1) as f64;
    serde_json::json!({
        "samples": samples.len(),
        "p50_us": percentile(&samples, 50.0).round(),
        "p99_us": percentile(&samples, 99.0).round(),
        "mean_us": mean.round(),
    })
}

/// `v[p]` over `base[p]` (two summaries' same percentile), to two decimals.
pub fn over(v: &serde_json::Value, base: &serde_json::Value, p: &str) -> f64 {
    let a = v[p].as_f64().unwrap_or(f64::NAN);
    let b = base[p].as_f64().unwrap_or(f64::NAN);
    ((a / b) * 100.0).round() / 100.0
}
