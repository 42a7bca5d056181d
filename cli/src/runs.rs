//! `turnstile run ...`: start, inspect and list runs (a message sequence driven to completion
//! on one session's lane), printed for people or as JSON.

use std::process::ExitCode;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use clap::{Args, Subcommand};
use turnstile_shared::api;
use turnstile_shared::duration;
use turnstile_shared::page::Page;
use turnstile_shared::runs::{RunLimits, RunRecord, RunRef, RunState, StartRun};
use turnstile_shared::schedules::ListRuns;
use turnstile_shared::subjects::{self, api as subj};
use turnstile_shared::{RunId, SessionId};

const API_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a start keeps retrying a request lost with a replica or a server (the run's id
/// makes a repeat return the first attempt's run).
const RETRY_DEADLINE: Duration = Duration::from_secs(30);

/// Run ceilings; an absent flag keeps the `RunLimits` default.
#[derive(Args, Debug, Clone, Default)]
pub struct LimitArgs {
    /// Most agent rounds the whole run may take (default 100).
    #[arg(long)]
    pub max_rounds: Option<u32>,
    /// Longest the run may go, e.g. 90m (default 3h).
    #[arg(long, value_parser = duration::parse_flag)]
    pub max_duration: Option<Duration>,
    /// Longest a run may wait on its children without progress (a step event or heartbeat),
    /// e.g. 5m (default 10m).
    #[arg(long, value_parser = duration::parse_flag)]
    pub idle_timeout: Option<Duration>,
}

impl LimitArgs {
    pub fn limits(&self) -> RunLimits {
        let d = RunLimits::default();
        RunLimits {
            max_rounds: self.max_rounds.unwrap_or(d.max_rounds),
            max_duration: self.max_duration.unwrap_or(d.max_duration),
            idle_timeout: self.idle_timeout.unwrap_or(d.idle_timeout),
        }
    }
}

#[derive(Subcommand)]
pub enum RunCommand {
    /// Queue a run of these messages on a session; prints its id. With --wait, exit 0 if it
    /// completed and 1 if it failed.
    Start {
        #[arg(long)]
        session: SessionId,
        /// A message to send, in order (repeat for more).
        #[arg(long = "message", required = true)]
        messages: Vec<String>,
        /// Sent last, once every message completed.
        #[arg(long)]
        finalizer: Option<String>,
        #[command(flatten)]
        limits: LimitArgs,
        /// Wait for the run to end.
        #[arg(long)]
        wait: bool,
        #[arg(long)]
        json: bool,
    },
    /// One run: status, times, limits and each message's rounds.
    Show {
        id: RunId,
        #[arg(long)]
        json: bool,
    },
    /// Runs, optionally only those a schedule fired.
    List {
        #[arg(long)]
        schedule: Option<String>,
        #[command(flatten)]
        page: crate::paging::PageArgs,
        #[arg(long)]
        json: bool,
    },
    /// Retry a failed run: it continues where it failed (a failed hand-over is redone with the
    /// completions pending now; finished steps are never re-run).
    Retry {
        id: RunId,
        #[arg(long)]
        json: bool,
    },
    /// Cancel a run: a queued one ends at once; a running one after its turn in flight, with
    /// the work it owns cancelled. Ends `failed: cancelled`.
    Cancel {
        id: RunId,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(url: &str, cmd: RunCommand) -> anyhow::Result<ExitCode> {
    let client = turnstile_shared::config::connect_once(url, "turnstile-cli").await?;
    match cmd {
        RunCommand::Start {
            session,
            messages,
            finalizer,
            limits,
            wait,
            json,
        } => {
            let req = StartRun {
                session,
                messages,
                finalizer,
                limits: limits.limits(),
                schedule: None,
                id: Some(RunId::new()),
            };
            return start(&client, req, wait, json).await;
        }
        RunCommand::Show { id, json } => {
            let rec: RunRecord =
                api::call(&client, subj::RUNS_SHOW, &RunRef { run: id }, API_TIMEOUT).await?;
            if json {
                println!("{}", serde_json::to_string(&rec)?);
            } else {
                print_run(&rec);
            }
        }
        RunCommand::Retry { id, json } => {
            let rec: RunRecord =
                api::call(&client, subj::RUNS_RETRY, &RunRef { run: id }, API_TIMEOUT).await?;
            if json {
                println!("{}", serde_json::to_string(&rec)?);
            } else {
                println!("{} queued again (attempt {})", rec.id, rec.attempt);
            }
        }
        RunCommand::Cancel { id, json } => {
            let rec: RunRecord =
                api::call(&client, subj::RUNS_CANCEL, &RunRef { run: id }, API_TIMEOUT).await?;
            if json {
                println!("{}", serde_json::to_string(&rec)?);
            } else {
                println!(
                    "{} {}",
                    rec.id,
                    if rec.state.is_terminal() {
                        "cancelled"
                    } else {
                        "cancelling (stops after its turn in flight)"
                    }
                );
            }
        }
        RunCommand::List {
            schedule,
            page,
            json,
        } => {
            let req = ListRuns {
                schedule,
                page: page.request(),
            };
            let page: Page<RunRecord> =
                api::call(&client, subj::RUNS_LIST, &req, API_TIMEOUT).await?;
            let recs = &page.items;
            if json {
                println!("{}", serde_json::to_string(&page)?);
            } else {
                crate::paging::more(&page);
                println!(
                    "{:<40} {:<9} {:>6}  {:<20} CREATED",
                    "RUN", "STATUS", "ROUNDS", "SCHEDULE"
                );
                for r in recs {
                    println!("{}", list_line(r));
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn start(
    client: &async_nats::Client,
    req: StartRun,
    wait: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    // Watch before starting, so the outcome cannot slip by between the two.
    let waiting = match (&req.id, wait) {
        (Some(id), true) => {
            Some(crate::wait::RecordWait::start(client, subjects::RUNS_BUCKET, id.as_str()).await?)
        }
        _ => None,
    };
    let rec: RunRecord =
        api::call_idempotent(client, subj::RUNS_START, &req, API_TIMEOUT, RETRY_DEADLINE).await?;
    let Some(waiting) = waiting else {
        if json {
            println!("{}", serde_json::to_string(&rec)?);
        } else {
            println!("{}", rec.id);
        }
        return Ok(ExitCode::SUCCESS);
    };
    if !json {
        println!("{}", rec.id);
    }
    let rec = waiting.until(|r: &RunRecord| r.state.is_terminal()).await;
    if json {
        println!("{}", serde_json::to_string(&rec)?);
    }
    match &rec.state {
        RunState::Completed {
            started_at,
            ended_at,
        } => {
            if !json {
                println!(
                    "{} completed: {} rounds in {}",
                    rec.id,
                    rec.rounds(),
                    duration::format(span(*started_at, *ended_at))
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        RunState::Failed { .. } => {
            if !json {
                println!("{} {}", rec.id, status_line(&rec));
            }
            Ok(ExitCode::from(1))
        }
        _ => Ok(ExitCode::from(1)),
    }
}

/// `failed: REASON: DETAIL (at message #I, execution X)`, or the bare status name.
fn status_line(r: &RunRecord) -> String {
    match &r.state {
        RunState::Failed {
            reason,
            detail,
            message_index,
            execution,
            ..
        } => {
            let at = if *message_index >= r.messages.len() && r.finalizer.is_some() {
                "the finalizer".to_string()
            } else {
                format!("message #{message_index}")
            };
            let exec = execution
                .as_ref()
                .map(|e| format!(", execution {e}"))
                .unwrap_or_default();
            format!("failed: {reason}: {detail} (at {at}{exec})")
        }
        s => s.name().to_string(),
    }
}

fn print_run(r: &RunRecord) {
    println!("run        {}", r.id);
    println!("session    {}", r.session);
    println!("status     {}", status_line(r));
    println!(
        "schedule   {}",
        r.schedule.as_deref().unwrap_or("- (started by hand)")
    );
    println!("created    {}", fmt_time(r.created_at));
    let (started, ended) = match &r.state {
        RunState::Queued => (None, None),
        RunState::Running { started_at } => (Some(*started_at), None),
        RunState::Completed {
            started_at,
            ended_at,
        } => (Some(*started_at), Some(*ended_at)),
        RunState::Failed {
            started_at,
            ended_at,
            ..
        } => (*started_at, Some(*ended_at)),
    };
    if let Some(s) = started {
        println!("started    {}", fmt_time(s));
    }
    match (started, ended) {
        (Some(s), Some(e)) => println!(
            "ended      {} (took {})",
            fmt_time(e),
            duration::format(span(s, e))
        ),
        (None, Some(e)) => println!("ended      {} (never started)", fmt_time(e)),
        (Some(s), None) => println!("running    for {}", duration::format(span(s, Utc::now()))),
        (None, None) => {}
    }
    println!("limits     {}", limits_line(&r.limits));
    println!("messages:");
    for (i, text) in r.texts().iter().enumerate() {
        let label = if i >= r.messages.len() {
            "finalizer".to_string()
        } else {
            format!("#{i}")
        };
        println!("  {label:<9} {:?}", first_line(text));
        match r.progress.get(i) {
            Some(p) => {
                let turns: Vec<&str> = p.turns.iter().map(|t| t.as_str()).collect();
                println!(
                    "            rounds {}{}  {}",
                    p.turns.len(),
                    if p.done { ", done" } else { "" },
                    turns.join(" ")
                );
            }
            None => println!("            not begun"),
        }
    }
    println!("rounds     {} in all", r.rounds());
}

/// `id  status  rounds  schedule  created`.
fn list_line(r: &RunRecord) -> String {
    format!(
        "{:<40} {:<9} {:>6}  {:<20} {}",
        r.id.as_str(),
        r.state.name(),
        r.rounds(),
        r.schedule.as_deref().unwrap_or("-"),
        fmt_time(r.created_at)
    )
}

pub(crate) fn limits_line(l: &RunLimits) -> String {
    format!(
        "max {} rounds, max duration {}, idle timeout {}",
        l.max_rounds,
        duration::format(l.max_duration),
        duration::format(l.idle_timeout)
    )
}

fn span(from: DateTime<Utc>, to: DateTime<Utc>) -> Duration {
    (to - from).to_std().unwrap_or_default()
}

/// RFC 3339 in UTC, to the second.
pub(crate) fn fmt_time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// The first line of a message, at most 60 characters.
pub(crate) fn first_line(s: &str) -> String {
    let line = s.lines().next().unwrap_or_default();
    let mut out: String = line.chars().take(60).collect();
    if line.chars().count() > 60 || s.lines().nth(1).is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnstile_shared::runs::MessageProgress;

    #[test]
    fn durations_read_well() {
        assert_eq!(first_line("fix it\nplease"), "fix it…");
        assert_eq!(first_line("short"), "short");
    }

    #[test]
    fn failed_runs_name_the_message_or_finalizer() {
        let t = DateTime::from_timestamp(1_790_000_000, 0).unwrap_or_default();
        let mut r = RunRecord {
            id: RunId::new(),
            session: SessionId::new(),
            schedule: Some("nightly".into()),
            created_at: t,
            messages: vec!["a".into(), "b".into()],
            finalizer: Some("wrap up".into()),
            limits: RunLimits::default(),
            progress: vec![MessageProgress {
                turns: vec![RunId::new().turn(0, 0), RunId::new().turn(0, 1)],
                done: true,
            }],
            cancel: None,
            attempt: 0,
            driver: None,
            state: RunState::Failed {
                started_at: Some(t),
                ended_at: t,
                reason: "max_rounds".into(),
                detail: "100 rounds".into(),
                message_index: 2,
                execution: None,
            },
        };
        assert_eq!(
            status_line(&r),
            "failed: max_rounds: 100 rounds (at the finalizer)"
        );
        if let RunState::Failed { message_index, .. } = &mut r.state {
            *message_index = 1;
        }
        assert!(status_line(&r).ends_with("(at message #1)"));
        let line = list_line(&r);
        assert!(line.contains(" failed ") && line.contains("nightly"));
        assert!(line.contains("     2  ") && line.ends_with("2026-09-21T14:13:20Z"));
    }
}
