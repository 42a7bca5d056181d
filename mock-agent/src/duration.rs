//! Parses the human-friendly durations used by the `!sleep` directive (`500ms`, `2s`, `1m`, `3`).

use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Parses a duration such as `500ms`, `2s`, `1.5s`, `1m`, `1h` or a bare number of seconds (`3`).
///
/// Surrounding whitespace is ignored; the number must be finite and non-negative.
pub fn parse_duration(text: &str) -> Result<Duration> {
    let text = text.trim();
    if text.is_empty() {
        bail!("empty duration");
    }
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    if number.is_empty() {
        bail!("duration {text:?} does not start with a number");
    }
    let value: f64 = number
        .parse()
        .with_context(|| format!("invalid number {number:?} in duration {text:?}"))?;
    let seconds_per_unit = match unit.trim() {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        other => bail!("unknown unit {other:?} in duration {text:?} (use ms, s, m or h)"),
    };
    Duration::try_from_secs_f64(value * seconds_per_unit)
        .with_context(|| format!("duration {text:?} is out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1m").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("0ms").unwrap(), Duration::ZERO);
    }

    #[test]
    fn bare_number_is_seconds() {
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("  7 ").unwrap(), Duration::from_secs(7));
    }

    #[test]
    fn fractions_are_accepted() {
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("0.25").unwrap(), Duration::from_millis(250));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "", "   ", "ms", "s", "abc", "5x", "1.2.3s", "-1s", "5 sec", "1e3",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
