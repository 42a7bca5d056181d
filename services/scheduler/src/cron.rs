//! Cron expressions in an IANA time zone -> slot instants (UTC). Pure: no clock, no I/O.
//! The `cron` crate parses and matches fields; this module adapts crontab syntax to it and
//! resolves local wall-clock times in the zone itself, because the crate natively drops a
//! slot that falls in a skipped hour and yields a repeated-hour slot twice.
//!
//! - Each local wall-clock time the expression matches gives exactly one instant. In a skipped
//!   hour (spring forward) it fires at the first instant after the gap ("30 2 * * *" on
//!   2026-03-08 in New York fires at 03:00 EDT); in a repeated hour (fall back) it fires once, at
//!   the first occurrence. So hourly jobs fire 23 times on the long day (the repeated hour's
//!   second pass is not re-run), and times that collapse onto the gap's end fire once.
//! - Day of week is crontab's: 0-7 (0 and 7 = Sunday), names in any case (3+ letter prefixes:
//!   `mon`, `Tues`, `friday`), lists, ranges, `*/n` and `a-b/n` steps; a step needs `*` or a
//!   range before it (`1/2` is refused). It is mapped to the crate's 1-7 (1 = Sunday) numbering.
//! - Day of month and day of week follow vixie cron: if both are restricted (neither starts
//!   with `*` or `?`) a day matches if EITHER matches; otherwise both must match.
//! - 5 fields are crontab (seconds = 0); 6 or 7 fields put seconds first, and a 7th field is
//!   a year (1970-2100) passed through. Macros: @yearly/@annually, @monthly, @weekly,
//!   @daily/@midnight, @hourly.

use std::str::FromStr;

use ::cron::Schedule;
use chrono::{DateTime, NaiveDateTime, TimeDelta, TimeZone, Utc};
use chrono_tz::Tz;

/// Field names by position once seconds come first, and what each accepts (the crate's
/// messages say "less than 59" for 0-59).
const FIELDS: [(&str, &str); 7] = [
    ("second", "0-59"),
    ("minute", "0-59"),
    ("hour", "0-23"),
    ("day-of-month", "1-31"),
    ("month", "1-12 or JAN-DEC"),
    ("day-of-week", "0-7 or SUN-SAT"),
    ("year", "1970-2100"),
];
/// Day names from Sunday = 0; any prefix of three letters or more is accepted, in any case.
const DAYS: [&str; 7] = [
    "sunday",
    "monday",
    "tuesday",
    "wednesday",
    "thursday",
    "friday",
    "saturday",
];
/// Longest skipped stretch of local time searched for its end (real gaps are an hour or a day).
const MAX_GAP_MINUTES: u32 = 48 * 60;

#[derive(Debug, thiserror::Error)]
pub enum CronError {
    #[error("empty cron expression")]
    Empty,
    #[error("cron expression `{expr}` has {count} fields; expected 5 (minute hour day-of-month month day-of-week), 6 (seconds first) or 7 (seconds first, year last)")]
    FieldCount { expr: String, count: usize },
    #[error("unknown cron macro `{0}`; expected @yearly, @annually, @monthly, @weekly, @daily, @midnight or @hourly")]
    UnknownMacro(String),
    #[error("invalid {field} field `{value}` in cron expression `{expr}`: {reason}")]
    Field {
        expr: String,
        field: &'static str,
        value: String,
        reason: String,
    },
    #[error("invalid cron expression `{expr}`: {reason}")]
    Expression { expr: String, reason: String },
    #[error("unknown time zone `{0}`; expected an IANA name such as `Europe/Berlin`")]
    UnknownZone(String),
}

/// A parsed cron expression in its zone.
#[derive(Debug, Clone)]
pub struct CronSpec {
    expr: String,
    zone: Tz,
    /// Matchers over local wall-clock times; two when day-of-month OR day-of-week applies.
    schedules: Vec<Schedule>,
}

impl CronSpec {
    /// `expr`: 5-field crontab ("0 10,15,20 * * *"), 6 or 7 fields with seconds first
    /// ("*/20 * * * * *"), or a macro (@daily, ...). `zone`: IANA name ("Asia/Kolkata").
    pub fn parse(expr: &str, zone: &str) -> Result<CronSpec, CronError> {
        let expr = expr.trim();
        if expr.is_empty() {
            return Err(CronError::Empty);
        }
        let crontab = if expr.starts_with('@') {
            expand_macro(expr)?
        } else {
            expr
        };
        let mut fields: Vec<String> = crontab.split_whitespace().map(str::to_owned).collect();
        match fields.len() {
            5 => fields.insert(0, "0".to_owned()),
            6 | 7 => {}
            count => {
                return Err(CronError::FieldCount {
                    expr: expr.to_owned(),
                    count,
                })
            }
        }
        let field_error = |fields: &[String], i: usize, reason: String| CronError::Field {
            expr: expr.to_owned(),
            field: FIELDS[i].0,
            value: fields[i].clone(),
            reason,
        };
        let either_day = restricted(&fields[3]) && restricted(&fields[5]);
        let dow = map_dow(&fields[5]).map_err(|reason| field_error(&fields, 5, reason))?;
        // Each field alone in an otherwise all-matching expression, so errors name it.
        for (i, field) in fields.iter().enumerate() {
            let mut probe = ["0", "0", "0", "*", "*", "*", "*"];
            probe[i] = if i == 5 { dow.as_str() } else { field.as_str() };
            if let Err(e) = Schedule::from_str(&probe[..fields.len()].join(" ")) {
                // The crate's message repeats the probe with a caret; keep its last line.
                let said = e.to_string().lines().last().unwrap_or_default().to_owned();
                let reason = format!("{said} (allowed: {})", FIELDS[i].1);
                return Err(field_error(&fields, i, reason));
            }
        }
        fields[5] = dow;
        let variants = if either_day {
            vec![with_field(&fields, 5, "*"), with_field(&fields, 3, "*")]
        } else {
            vec![fields]
        };
        let schedules = variants
            .iter()
            .map(|f| Schedule::from_str(&f.join(" ")))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| CronError::Expression {
                expr: expr.to_owned(),
                reason: e.to_string(),
            })?;
        let zone = zone
            .trim()
            .parse::<Tz>()
            .map_err(|_| CronError::UnknownZone(zone.to_owned()))?;
        Ok(CronSpec {
            expr: expr.to_owned(),
            zone,
            schedules,
        })
    }

    /// The expression as written (trimmed).
    pub fn expr(&self) -> &str {
        &self.expr
    }

    pub fn zone(&self) -> Tz {
        self.zone
    }

    /// The first slot strictly after `after`.
    pub fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        // Slot instants never decrease as local times increase, so walk local times from the
        // wall clock at `after`; only a repeated hour yields instants at or before `after`.
        let mut cursor = after.with_timezone(&self.zone).naive_local();
        loop {
            let local = self.next_local(cursor)?;
            match self.resolve(local) {
                Some(at) if at > after => return Some(at),
                _ => cursor = local,
            }
        }
    }

    /// Up to `limit` slots in (from, to], ascending, each exactly once.
    pub fn slots_between(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        limit: usize,
    ) -> Vec<DateTime<Utc>> {
        self.iter_after(from)
            .take_while(|&at| at <= to)
            .take(limit)
            .collect()
    }

    /// The next `n` slots after `after`.
    pub fn upcoming(&self, after: DateTime<Utc>, n: usize) -> Vec<DateTime<Utc>> {
        self.iter_after(after).take(n).collect()
    }

    fn iter_after(&self, after: DateTime<Utc>) -> impl Iterator<Item = DateTime<Utc>> + '_ {
        std::iter::successors(self.next_after(after), |&at| self.next_after(at))
    }

    /// The first matching local wall-clock time after `cursor` (the crate sees it as UTC, which
    /// has no gaps or repeats).
    fn next_local(&self, cursor: NaiveDateTime) -> Option<NaiveDateTime> {
        let fake = Utc.from_utc_datetime(&cursor);
        self.schedules
            .iter()
            .filter_map(|s| s.after(&fake).next())
            .map(|at| at.naive_utc())
            .min()
    }

    /// The instant of a local time: its first occurrence, or the end of the gap it falls in.
    fn resolve(&self, local: NaiveDateTime) -> Option<DateTime<Utc>> {
        let valid = |t: NaiveDateTime| self.zone.from_local_datetime(&t).earliest();
        if let Some(at) = valid(local) {
            return Some(at.with_timezone(&Utc));
        }
        // Find the first valid minute, then the gap's end to the second before it.
        let (mut lo, mut hi) = (local, local);
        for _ in 0..MAX_GAP_MINUTES {
            hi = hi.checked_add_signed(TimeDelta::minutes(1))?;
            if valid(hi).is_some() {
                while hi - lo > TimeDelta::seconds(1) {
                    let mid = lo + TimeDelta::seconds((hi - lo).num_seconds() / 2);
                    if valid(mid).is_some() {
                        hi = mid;
                    } else {
                        lo = mid;
                    }
                }
                return valid(hi).map(|at| at.with_timezone(&Utc));
            }
            lo = hi;
        }
        None
    }
}

fn expand_macro(expr: &str) -> Result<&'static str, CronError> {
    Ok(match expr.to_ascii_lowercase().as_str() {
        "@yearly" | "@annually" => "0 0 1 1 *",
        "@monthly" => "0 0 1 * *",
        "@weekly" => "0 0 * * 0",
        "@daily" | "@midnight" => "0 0 * * *",
        "@hourly" => "0 * * * *",
        _ => return Err(CronError::UnknownMacro(expr.to_owned())),
    })
}

/// Vixie cron's test: a day field starting with `*` (or `?`) does not restrict.
fn restricted(field: &str) -> bool {
    !(field.starts_with('*') || field.starts_with('?'))
}

fn with_field(fields: &[String], i: usize, value: &str) -> Vec<String> {
    let mut fields = fields.to_vec();
    fields[i] = value.to_owned();
    fields
}

/// Crontab day of week (0-7, 0 and 7 = Sunday, names) -> the crate's list (1-7, 1 = Sunday).
fn map_dow(field: &str) -> Result<String, String> {
    if field == "*" || field == "?" {
        return Ok(field.to_owned());
    }
    let value = |s: &str| -> Result<u32, String> {
        let lower = s.to_ascii_lowercase();
        match lower.parse::<u32>() {
            Ok(n) if n <= 7 => Ok(n),
            Ok(_) => Err(format!("day of week `{s}` is out of range 0-7")),
            Err(_) => (0..7)
                .find(|&d| lower.len() >= 3 && DAYS[d as usize].starts_with(&lower))
                .ok_or_else(|| format!("`{s}` is not a day of week (0-7 or a name like MON)")),
        }
    };
    let mut days = [false; 7];
    for item in field.split(',') {
        let (base, step) = match item.split_once('/') {
            None => (item, None),
            Some((base, step)) => match step.parse::<usize>() {
                Ok(s) if s > 0 => (base, Some(s)),
                _ => return Err(format!("bad step `{step}` in `{item}`")),
            },
        };
        let (lo, hi) = match base.split_once('-') {
            _ if base == "*" || base == "?" => (0, 6),
            Some((a, b)) => (value(a)?, value(b)?),
            None if step.is_some() => {
                return Err(format!("step `{item}` needs `*` or a range, e.g. `1-5/2`"))
            }
            None => (value(base)?, value(base)?),
        };
        if lo > hi {
            return Err(format!("range `{base}` runs backwards"));
        }
        for day in (lo..=hi).step_by(step.unwrap_or(1)) {
            days[(day % 7) as usize] = true;
        }
    }
    let list: Vec<String> = (1..=7)
        .filter(|&d| days[d - 1])
        .map(|d| d.to_string())
        .collect();
    Ok(list.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Datelike;

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }
    fn spec(expr: &str, zone: &str) -> CronSpec {
        CronSpec::parse(expr, zone).unwrap()
    }
    fn upcoming(expr: &str, zone: &str, after: &str, n: usize) -> Vec<DateTime<Utc>> {
        spec(expr, zone).upcoming(at(after), n)
    }
    fn ats(list: &[&str]) -> Vec<DateTime<Utc>> {
        list.iter().map(|s| at(s)).collect()
    }
    /// Weekdays (1 = Monday .. 7 = Sunday) of two weeks of slots at noon UTC.
    fn weekdays(dow: &str) -> Vec<u32> {
        let slots = spec(&format!("0 12 * * {dow}"), "UTC").slots_between(
            at("2026-06-01T00:00:00Z"),
            at("2026-06-15T00:00:00Z"),
            100,
        );
        let mut days: Vec<u32> = slots
            .iter()
            .map(|t| t.weekday().number_from_monday())
            .collect();
        days.sort_unstable();
        days.dedup();
        days
    }

    #[test]
    fn parses_five_six_and_seven_fields() {
        let kolkata = [
            "2026-01-01T04:30:00Z",
            "2026-01-01T09:30:00Z",
            "2026-01-01T14:30:00Z",
        ];
        let got = upcoming(
            "0 10,15,20 * * *",
            "Asia/Kolkata",
            "2026-01-01T00:00:00Z",
            3,
        );
        assert_eq!(got, ats(&kolkata));
        let got = upcoming(
            "0 0 10,15,20 * * *",
            "Asia/Kolkata",
            "2026-01-01T00:00:00Z",
            3,
        );
        assert_eq!(got, ats(&kolkata));
        let years = spec("0 0 12 1 1 * 2027", "UTC");
        assert_eq!(
            years.upcoming(at("2026-01-01T00:00:00Z"), 5),
            ats(&["2027-01-01T12:00:00Z"])
        );
        assert_eq!(years.zone(), chrono_tz::UTC);
    }

    #[test]
    fn trims_and_accepts_any_whitespace() {
        let s = spec(" \t0  10,15,20\t* * *\n", " Asia/Kolkata ");
        assert_eq!(s.expr(), "0  10,15,20\t* * *");
        assert_eq!(s.zone(), chrono_tz::Asia::Kolkata);
        assert_eq!(
            s.next_after(at("2026-01-01T05:00:00Z")),
            Some(at("2026-01-01T09:30:00Z"))
        );
    }

    #[test]
    fn macros() {
        let after = "2026-06-10T10:30:00Z"; // a Wednesday
        for (m, next) in [
            ("@yearly", "2027-01-01T00:00:00Z"),
            ("@annually", "2027-01-01T00:00:00Z"),
            ("@monthly", "2026-07-01T00:00:00Z"),
            ("@weekly", "2026-06-14T00:00:00Z"),
            ("@daily", "2026-06-11T00:00:00Z"),
            ("@MIDNIGHT", "2026-06-11T00:00:00Z"),
            ("@hourly", "2026-06-10T11:00:00Z"),
        ] {
            assert_eq!(upcoming(m, "UTC", after, 1), ats(&[next]), "{m}");
        }
    }

    #[test]
    fn day_of_week_uses_crontab_numbering() {
        assert_eq!(weekdays("0"), [7]);
        assert_eq!(weekdays("7"), [7]);
        assert_eq!(weekdays("SUN"), [7]);
        assert_eq!(weekdays("1-5"), [1, 2, 3, 4, 5]);
        assert_eq!(weekdays("mon-FRI"), [1, 2, 3, 4, 5]);
        assert_eq!(weekdays("Monday,wed,5"), [1, 3, 5]);
        assert_eq!(weekdays("1,3,5"), [1, 3, 5]);
        assert_eq!(weekdays("tues,THURS,Saturday"), [2, 4, 6]);
        assert_eq!(weekdays("1-5/2"), [1, 3, 5]);
        assert_eq!(weekdays("*/2"), [2, 4, 6, 7]);
        assert_eq!(weekdays("5-7"), [5, 6, 7]);
        assert_eq!(weekdays("0-7"), [1, 2, 3, 4, 5, 6, 7]);
    }

    #[test]
    fn day_of_month_and_week_follow_vixie() {
        // Both restricted: the 1st OR a Monday (July 2026: Wed 1st, Mondays 6/13/20/27).
        let either = spec("0 12 1 * MON", "UTC");
        let july = either.slots_between(at("2026-06-30T12:00:00Z"), at("2026-07-31T12:00:00Z"), 50);
        let days: Vec<u32> = july.iter().map(|t| t.day()).collect();
        assert_eq!(days, [1, 6, 13, 20, 27]);
        // Day of week starting with `*`: both must match (the first Sunday of each month).
        let both = upcoming("0 12 1-7 * */7", "UTC", "2026-06-01T00:00:00Z", 3);
        let want = [
            "2026-06-07T12:00:00Z",
            "2026-07-05T12:00:00Z",
            "2026-08-02T12:00:00Z",
        ];
        assert_eq!(both, ats(&want));
    }

    #[test]
    fn errors_name_what_is_wrong() {
        assert!(matches!(
            CronSpec::parse("  ", "UTC"),
            Err(CronError::Empty)
        ));
        for (expr, count) in [("* * * *", 4), ("0 0 0 * * * * *", 8)] {
            let err = CronSpec::parse(expr, "UTC").unwrap_err();
            assert!(matches!(err, CronError::FieldCount { count: c, .. } if c == count));
            assert!(
                err.to_string().contains(&format!("has {count} fields")),
                "{err}"
            );
        }
        for (expr, field, value) in [
            ("61 * * * *", "minute", "61"),
            ("0 24 * * *", "hour", "24"),
            ("0 0 32 * *", "day-of-month", "32"),
            ("0 0 * 13 *", "month", "13"),
            ("0 0 * * 8", "day-of-week", "8"),
            ("0 0 * * FOO", "day-of-week", "FOO"),
            ("0 0 * * 5-1", "day-of-week", "5-1"),
            ("0 0 * * 1/2", "day-of-week", "1/2"),
            ("0 0 * * 1,,2", "day-of-week", "1,,2"),
            ("x 0 0 * * *", "second", "x"),
        ] {
            let err = CronSpec::parse(expr, "UTC").unwrap_err();
            let msg = err.to_string();
            assert!(
                matches!(err, CronError::Field { field: f, .. } if f == field),
                "{msg}"
            );
            assert!(msg.contains(&format!("{field} field `{value}`")), "{msg}");
        }
        let err = CronSpec::parse("@reboot", "UTC").unwrap_err();
        assert!(err.to_string().contains("`@reboot`"), "{err}");
        let err = CronSpec::parse("0 10 * * *", "Mars/Olympus").unwrap_err();
        assert!(matches!(err, CronError::UnknownZone(_)));
        assert!(err.to_string().contains("`Mars/Olympus`"), "{err}");
    }

    #[test]
    fn next_after_is_strictly_after() {
        let s = spec("0 10,15,20 * * *", "Asia/Kolkata");
        assert_eq!(
            s.next_after(at("2026-01-01T04:30:00Z")),
            Some(at("2026-01-01T09:30:00Z"))
        );
        let just_before = at("2026-01-01T04:29:59.999Z");
        assert_eq!(s.next_after(just_before), Some(at("2026-01-01T04:30:00Z")));
        let past_end = spec("0 0 12 1 1 * 2027", "UTC");
        assert_eq!(past_end.next_after(at("2027-01-01T12:00:00Z")), None);
    }

    #[test]
    fn slots_between_excludes_from_includes_to_and_limits() {
        let s = spec("0 10,15,20 * * *", "Asia/Kolkata");
        let (from, to) = (at("2026-01-01T04:30:00Z"), at("2026-01-02T04:30:00Z"));
        let all = [
            "2026-01-01T09:30:00Z",
            "2026-01-01T14:30:00Z",
            "2026-01-02T04:30:00Z",
        ];
        assert_eq!(s.slots_between(from, to, 10), ats(&all));
        assert_eq!(s.slots_between(from, to, 2), ats(&all[..2]));
        assert!(s.slots_between(from, to, 0).is_empty());
        assert!(s.slots_between(to, from, 10).is_empty());
    }

    #[test]
    fn seconds_schedule() {
        let got = upcoming("*/20 * * * * *", "UTC", "2026-01-01T12:00:05Z", 4);
        let want = [
            "2026-01-01T12:00:20Z",
            "2026-01-01T12:00:40Z",
            "2026-01-01T12:01:00Z",
        ];
        assert_eq!(got[..3], ats(&want));
        assert_eq!(got[3], at("2026-01-01T12:01:20Z"));
        // Across New York's gap: 02:00:00-02:59:40 local collapse onto 03:00 EDT, once.
        let got = upcoming(
            "*/20 * * * * *",
            "America/New_York",
            "2026-03-08T06:59:50Z",
            3,
        );
        let want = [
            "2026-03-08T07:00:00Z",
            "2026-03-08T07:00:20Z",
            "2026-03-08T07:00:40Z",
        ];
        assert_eq!(got, ats(&want));
    }

    #[test]
    fn daily_slot_in_skipped_hour_fires_at_gap_end() {
        let ny = upcoming("30 2 * * *", "America/New_York", "2026-03-07T00:00:00Z", 3);
        let want = [
            "2026-03-07T07:30:00Z",
            "2026-03-08T07:00:00Z",
            "2026-03-09T06:30:00Z",
        ];
        assert_eq!(ny, ats(&want));
        let berlin = upcoming("30 2 * * *", "Europe/Berlin", "2026-03-28T00:00:00Z", 3);
        let want = [
            "2026-03-28T01:30:00Z",
            "2026-03-29T01:00:00Z",
            "2026-03-30T00:30:00Z",
        ];
        assert_eq!(berlin, ats(&want));
    }

    #[test]
    fn daily_slot_in_repeated_hour_fires_once_at_first_occurrence() {
        let ny = spec("30 1 * * *", "America/New_York");
        let want = [
            "2026-10-31T05:30:00Z",
            "2026-11-01T05:30:00Z",
            "2026-11-02T06:30:00Z",
        ];
        assert_eq!(ny.upcoming(at("2026-10-31T00:00:00Z"), 3), ats(&want));
        // From inside the repeated hour (01:15 EST), the next slot is the following day.
        let next = ny.next_after(at("2026-11-01T06:15:00Z"));
        assert_eq!(next, Some(at("2026-11-02T06:30:00Z")));
        let berlin = upcoming("30 2 * * *", "Europe/Berlin", "2026-10-24T00:00:00Z", 3);
        let want = [
            "2026-10-24T00:30:00Z",
            "2026-10-25T00:30:00Z",
            "2026-10-26T01:30:00Z",
        ];
        assert_eq!(berlin, ats(&want));
    }

    /// Instants `from + k * step` for k in 1..=count, except the listed k.
    fn grid(from: &str, step_minutes: i64, count: i64, except: &[i64]) -> Vec<DateTime<Utc>> {
        (1..=count)
            .filter(|k| !except.contains(k))
            .map(|k| at(from) + TimeDelta::minutes(k * step_minutes))
            .collect()
    }

    #[test]
    fn hourly_and_half_hourly_across_new_york_transitions() {
        let day = |expr: &str, from: &str| {
            let to = at(from) + TimeDelta::hours(24);
            spec(expr, "America/New_York").slots_between(at(from), to, 1000)
        };
        // Spring forward: local 02:00 and 02:30 fold into 03:00 EDT (07:00Z), itself a slot;
        // every UTC hour / half hour of the 24 h comes out exactly once.
        let spring = "2026-03-08T00:00:00Z";
        assert_eq!(day("0 * * * *", spring), grid(spring, 60, 24, &[]));
        assert_eq!(day("*/30 * * * *", spring), grid(spring, 30, 48, &[]));
        // Fall back: 01:00-01:59 EDT (05:00Z-05:59Z) fire; their EST repeat (06:00Z, 06:30Z) not.
        let fall = "2026-11-01T00:00:00Z";
        let hourly = day("0 * * * *", fall);
        assert_eq!(hourly.len(), 23);
        assert_eq!(hourly, grid(fall, 60, 24, &[6]));
        let half = day("*/30 * * * *", fall);
        assert_eq!(half.len(), 46);
        assert_eq!(half, grid(fall, 30, 48, &[12, 13]));
    }
}
