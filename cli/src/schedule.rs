//! `turnstile schedule ...`: thin calls to the scheduler's API, printed for people or as JSON.

use std::process::ExitCode;
use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::Subcommand;
use turnstile_shared::api;
use turnstile_shared::duration;
use turnstile_shared::runs::RunRecord;
use turnstile_shared::schedules::{
    Backfill, Catchup, ListSchedules, Overlap, PauseSchedule, ScheduleRecord, ScheduleRef,
    ScheduleSpec, ScheduleView, SlotOutcome, SlotRecord,
};
use turnstile_shared::subjects::api as subj;
use turnstile_shared::SessionId;

use crate::runs::{first_line, fmt_time, limits_line, LimitArgs};

const API_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Subcommand)]
pub enum ScheduleCommand {
    /// Add a schedule: fire a run of these messages on a session at each cron slot.
    Add {
        /// Letters, digits, `-` and `_`; at most 40.
        #[arg(long)]
        name: String,
        /// Cron expression: 5 fields, 6 with seconds first, or a macro such as @daily,
        /// e.g. "0 9 * * 1-5" (docs/runs-and-schedules.md lists every form).
        #[arg(long)]
        cron: String,
        /// IANA zone the cron expression is read in, e.g. Asia/Kolkata.
        #[arg(long)]
        tz: String,
        #[arg(long)]
        session: SessionId,
        /// A message each run sends, in order (repeat for more).
        #[arg(long = "message", required = true)]
        messages: Vec<String>,
        /// Sent last in each run, once every message completed.
        #[arg(long)]
        finalizer: Option<String>,
        /// When a slot comes while the previous run still goes: skip, buffer_one,
        /// cancel_other or allow_all (default skip).
        #[arg(long, value_parser = str::parse::<Overlap>)]
        overlap: Option<Overlap>,
        /// How far back missed slots are considered when the scheduler comes back.
        #[arg(long, default_value = "1h", value_parser = duration::parse_flag)]
        catchup_window: Duration,
        /// Which missed slots in the window fire: latest, all or none (default latest).
        #[arg(long, value_parser = str::parse::<Catchup>)]
        catchup: Option<Catchup>,
        /// A slot fired later than this after its time is marked late.
        #[arg(long, default_value = "1m", value_parser = duration::parse_flag)]
        late_threshold: Duration,
        #[command(flatten)]
        limits: LimitArgs,
        #[arg(long)]
        json: bool,
    },
    /// List schedules.
    List {
        #[command(flatten)]
        page: crate::paging::PageArgs,
        #[arg(long)]
        json: bool,
    },
    /// One schedule: its spec, the next five fire times and its latest slots.
    Show {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Stop firing until resumed: slots meanwhile are recorded, not run.
    Pause {
        name: String,
        /// Why (shown by `schedule show`).
        #[arg(long, default_value = "")]
        note: String,
        #[arg(long)]
        json: bool,
    },
    /// Fire again.
    Resume {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Start a run of the schedule now, outside its slots; prints the run id.
    Trigger {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Fire the slots in (--from, --to] (RFC 3339) that have no record yet; prints each slot.
    Backfill {
        name: String,
        #[arg(long, value_parser = parse_time)]
        from: DateTime<Utc>,
        #[arg(long, value_parser = parse_time)]
        to: DateTime<Utc>,
        #[arg(long)]
        json: bool,
    },
    /// Delete a schedule (runs it fired go on).
    Delete {
        name: String,
        #[arg(long)]
        json: bool,
    },
}

fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("invalid RFC 3339 time {s:?} ({e}); use e.g. 2025-01-31T09:00:00Z"))
}

pub async fn run(url: &str, cmd: ScheduleCommand) -> anyhow::Result<ExitCode> {
    let client = turnstile_shared::config::connect_once(url, "turnstile-cli").await?;
    match cmd {
        ScheduleCommand::Add {
            name,
            cron,
            tz,
            session,
            messages,
            finalizer,
            overlap,
            catchup_window,
            catchup,
            late_threshold,
            limits,
            json,
        } => {
            let req = ScheduleSpec {
                name,
                cron,
                tz,
                session,
                messages,
                finalizer,
                overlap: overlap.unwrap_or_default(),
                catchup_window,
                catchup: catchup.unwrap_or_default(),
                late_threshold,
                limits: limits.limits(),
            };
            let rec: ScheduleRecord =
                api::call(&client, subj::SCHEDULES_ADD, &req, API_TIMEOUT).await?;
            print_record(&rec, json, &rec.spec.name)?;
        }
        ScheduleCommand::List { page, json } => {
            let req = ListSchedules {
                page: page.request(),
            };
            let page: turnstile_shared::page::Page<ScheduleRecord> =
                api::call(&client, subj::SCHEDULES_LIST, &req, API_TIMEOUT).await?;
            let recs = &page.items;
            if json {
                println!("{}", serde_json::to_string(&page)?);
            } else {
                crate::paging::more(&page);
                println!(
                    "{:<20} {:<16} {:<18} {:<36} {:<10} {:<6}  LAST RUN",
                    "NAME", "CRON", "TZ", "SESSION", "OVERLAP", "STATE"
                );
                for r in recs {
                    println!("{}", list_line(r));
                }
            }
        }
        ScheduleCommand::Show { name, json } => {
            let v: ScheduleView = api::call(
                &client,
                subj::SCHEDULES_SHOW,
                &ScheduleRef { name },
                API_TIMEOUT,
            )
            .await?;
            if json {
                println!("{}", serde_json::to_string(&v)?);
            } else {
                print_view(&v);
            }
        }
        ScheduleCommand::Pause { name, note, json } => {
            let rec: ScheduleRecord = api::call(
                &client,
                subj::SCHEDULES_PAUSE,
                &PauseSchedule { name, note },
                API_TIMEOUT,
            )
            .await?;
            print_record(&rec, json, &format!("paused {}", rec.spec.name))?;
        }
        ScheduleCommand::Resume { name, json } => {
            let rec: ScheduleRecord = api::call(
                &client,
                subj::SCHEDULES_RESUME,
                &ScheduleRef { name },
                API_TIMEOUT,
            )
            .await?;
            print_record(&rec, json, &format!("resumed {}", rec.spec.name))?;
        }
        ScheduleCommand::Trigger { name, json } => {
            let rec: RunRecord = api::call(
                &client,
                subj::SCHEDULES_TRIGGER,
                &ScheduleRef { name },
                API_TIMEOUT,
            )
            .await?;
            if json {
                println!("{}", serde_json::to_string(&rec)?);
            } else {
                println!("{}", rec.id);
            }
        }
        ScheduleCommand::Backfill {
            name,
            from,
            to,
            json,
        } => {
            let slots: Vec<SlotRecord> = api::call(
                &client,
                subj::SCHEDULES_BACKFILL,
                &Backfill { name, from, to },
                API_TIMEOUT,
            )
            .await?;
            if json {
                println!("{}", serde_json::to_string(&slots)?);
            } else if slots.is_empty() {
                println!("no slots in that range");
            } else {
                for s in &slots {
                    println!("{}", slot_line(s));
                }
            }
        }
        ScheduleCommand::Delete { name, json } => {
            let rec: ScheduleRecord = api::call(
                &client,
                subj::SCHEDULES_DELETE,
                &ScheduleRef { name },
                API_TIMEOUT,
            )
            .await?;
            print_record(&rec, json, &format!("deleted {}", rec.spec.name))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_record(rec: &ScheduleRecord, json: bool, text: &str) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(rec)?);
    } else {
        println!("{text}");
    }
    Ok(())
}

fn state(r: &ScheduleRecord) -> &'static str {
    if r.paused.is_some() {
        "paused"
    } else {
        "active"
    }
}

/// `name  cron  tz  session  overlap  state  last run`.
fn list_line(r: &ScheduleRecord) -> String {
    let s = &r.spec;
    format!(
        "{:<20} {:<16} {:<18} {:<36} {:<10} {:<6}  {}",
        s.name,
        s.cron,
        s.tz,
        s.session.as_str(),
        s.overlap,
        state(r),
        r.last_run.as_ref().map(|id| id.as_str()).unwrap_or("-")
    )
}

/// `slot  outcome  details`.
fn slot_line(s: &SlotRecord) -> String {
    let details = match &s.outcome {
        SlotOutcome::Fired {
            fired_at,
            drift_ms,
            late,
            run,
        } => format!(
            "at {} drift {drift_ms}ms{}  {run}",
            fmt_time(*fired_at),
            if *late { " LATE" } else { "" }
        ),
        SlotOutcome::Skipped { reason, yielded_to } => match yielded_to {
            Some(run) => format!("{reason} (yielded to {run})"),
            None => reason.clone(),
        },
        SlotOutcome::Missed { reason } => reason.clone(),
    };
    format!("{}  {:<7}  {details}", fmt_time(s.slot), s.outcome.name())
}

fn print_view(v: &ScheduleView) {
    let r = &v.schedule;
    let s = &r.spec;
    println!("schedule   {} ({})", s.name, state(r));
    if let Some(p) = &r.paused {
        if p.note.is_empty() {
            println!("paused     since {}", fmt_time(p.at));
        } else {
            println!("paused     since {}: {}", fmt_time(p.at), p.note);
        }
    }
    println!("cron       {}  (in {})", s.cron, s.tz);
    println!("session    {}", s.session);
    println!("overlap    {}", s.overlap);
    println!(
        "catch-up   {} within {}",
        s.catchup,
        duration::format(s.catchup_window)
    );
    println!("late after {}", duration::format(s.late_threshold));
    println!("limits     {}", limits_line(&s.limits));
    println!("created    {}", fmt_time(r.created_at));
    println!(
        "last run   {}",
        r.last_run.as_ref().map(|id| id.as_str()).unwrap_or("-")
    );
    if let Some(b) = r.buffered {
        println!("buffered   slot {}", fmt_time(b));
    }
    println!("messages:");
    for (i, m) in s.messages.iter().enumerate() {
        println!("  #{i:<8} {:?}", first_line(m));
    }
    if let Some(f) = &s.finalizer {
        println!("  finalizer {:?}", first_line(f));
    }
    println!("next:");
    if v.next.is_empty() {
        println!("  (none)");
    }
    for t in &v.next {
        println!("  {t}");
    }
    println!("slots:");
    if v.slots.is_empty() {
        println!("  (none yet)");
    }
    for slot in &v.slots {
        println!("  {}", slot_line(slot));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use turnstile_shared::RunId;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: ScheduleCommand,
    }

    #[test]
    fn add_defaults_match_the_wire_defaults() {
        let session = SessionId::new();
        let cli = Cli::try_parse_from([
            "t",
            "add",
            "--name",
            "n",
            "--cron",
            "0 * * * *",
            "--tz",
            "UTC",
            "--session",
            session.as_str(),
            "--message",
            "one",
            "--message",
            "two",
        ])
        .expect("parse");
        let ScheduleCommand::Add {
            catchup_window,
            late_threshold,
            overlap,
            catchup,
            limits,
            messages,
            ..
        } = cli.cmd
        else {
            panic!("not add");
        };
        let wire: ScheduleSpec = serde_json::from_value(serde_json::json!({
            "name": "n", "cron": "0 * * * *", "tz": "UTC", "session": session, "messages": ["x"]
        }))
        .expect("spec");
        assert_eq!(catchup_window, wire.catchup_window);
        assert_eq!(late_threshold, wire.late_threshold);
        assert_eq!(overlap.unwrap_or_default(), wire.overlap);
        assert_eq!(catchup.unwrap_or_default(), wire.catchup);
        assert_eq!(limits.limits(), wire.limits);
        assert_eq!(messages, ["one", "two"]);

        let err = Cli::try_parse_from([
            "t",
            "add",
            "--name",
            "n",
            "--cron",
            "0 * * * *",
            "--tz",
            "UTC",
            "--session",
            session.as_str(),
            "--message",
            "one",
            "--overlap",
            "cancel_everything",
        ])
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(err.contains("unknown overlap policy"), "{err}");
    }

    #[test]
    fn slot_lines() {
        let t = DateTime::from_timestamp(1_790_000_000, 0).unwrap_or_default();
        let run = RunId::new();
        let fired = SlotRecord {
            schedule: "n".into(),
            slot: t,
            recorded_at: t,
            outcome: SlotOutcome::Fired {
                fired_at: t + chrono::Duration::seconds(90),
                drift_ms: 90_000,
                late: true,
                run: run.clone(),
            },
        };
        let line = slot_line(&fired);
        assert!(line.starts_with(&fmt_time(t)));
        assert!(line.contains("fired") && line.contains("drift 90000ms LATE"));
        assert!(line.ends_with(run.as_str()));
        let skipped = SlotRecord {
            outcome: SlotOutcome::Skipped {
                reason: "overlap".into(),
                yielded_to: Some(run.clone()),
            },
            ..fired
        };
        assert!(slot_line(&skipped).ends_with(&format!("skipped  overlap (yielded to {run})")));
    }
}
