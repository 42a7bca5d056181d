//! The one duration grammar of flags, API fields and printed durations, so `--ready-timeout`,
//! `schedule add --late-threshold`, the mock agent's `!sleep` and `run show` all agree.
//! Parsing is `humantime`'s grammar (`500ms`, `3s`, `2m`, `1h30m`, `1 day`) plus two forms it
//! lacks: a bare number of seconds (`30`, `1.5`) and one decimal number with a unit (`1.5s`).

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid duration {text:?}: {why} (use e.g. 500ms, 3s, 1.5s, 2m, 1h30m, or bare seconds)")]
pub struct DurationError {
    pub text: String,
    pub why: String,
}

/// Parses a duration: `500ms`, `3s`, `1.5s`, `2m`, `1h30m`, `30` (seconds).
pub fn parse(text: &str) -> Result<Duration, DurationError> {
    let text = text.trim();
    let err = |why: String| DurationError {
        text: text.to_string(),
        why,
    };
    if text.is_empty() {
        return Err(err("empty".into()));
    }
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    if number.contains('.') || unit.is_empty() {
        // The forms humantime lacks: bare seconds, or one decimal number with a unit.
        let value: f64 = number
            .parse()
            .map_err(|_| err(format!("{number:?} is not a number")))?;
        let per_unit = match unit.trim() {
            "" | "s" => 1.0,
            "ms" => 0.001,
            "m" => 60.0,
            "h" => 3600.0,
            other => return Err(err(format!("unknown unit {other:?}"))),
        };
        return Duration::try_from_secs_f64(value * per_unit).map_err(|e| err(e.to_string()));
    }
    humantime::parse_duration(text).map_err(|e| err(e.to_string()))
}

/// Prints a duration compactly, at the precision a reader needs: `500ms`, `1.5s`, `45s`,
/// `2m30s`, `10m`, `3h`, `1h30m` (seconds are dropped from durations of an hour or more).
pub fn format(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    if ms < 60_000 {
        return if ms.is_multiple_of(1_000) {
            format!("{}s", ms / 1_000)
        } else {
            format!("{:.1}s", ms as f64 / 1000.0)
        };
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, (secs / 60) % 60, secs % 60);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if s > 0 && h == 0 {
        out.push_str(&format!("{s}s"));
    }
    out
}

/// `clap` value parser for duration flags.
pub fn parse_flag(text: &str) -> Result<Duration, String> {
    parse(text).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_humantime_bare_seconds_and_decimals() {
        let ms = Duration::from_millis;
        assert_eq!(parse("500ms"), Ok(ms(500)));
        assert_eq!(parse(" 3s "), Ok(ms(3_000)));
        assert_eq!(parse("2m"), Ok(ms(120_000)));
        assert_eq!(parse("1h30m"), Ok(ms(5_400_000)));
        assert_eq!(parse("1h 30m"), Ok(ms(5_400_000)));
        assert_eq!(parse("30"), Ok(ms(30_000)));
        assert_eq!(parse("1.5"), Ok(ms(1_500)));
        assert_eq!(parse("1.5s"), Ok(ms(1_500)));
        assert_eq!(parse("0.25m"), Ok(ms(15_000)));
        for bad in ["", "s", "-1s", "3 parsecs", "1.5x", "1..5s"] {
            let e = parse(bad).expect_err(bad);
            assert!(e.to_string().contains("invalid duration"), "{e}");
        }
    }

    #[test]
    fn formats_compactly_and_reads_back() {
        let cases = [
            (Duration::from_millis(500), "500ms"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_secs(45), "45s"),
            (Duration::from_secs(150), "2m30s"),
            (Duration::from_secs(600), "10m"),
            (Duration::from_secs(3 * 3600), "3h"),
            (Duration::from_secs(5400), "1h30m"),
        ];
        for (d, text) in cases {
            assert_eq!(format(d), text);
            assert_eq!(parse(text), Ok(d));
        }
    }
}
