//! `turnstile events`: follows `TS_EVENTS` with an ordered consumer, one line per event for
//! people or one envelope per line with `--json`.

use std::io::Write;
use std::process::ExitCode;
use turnstile_shared::events::EventKind;

use anyhow::Context;
use async_nats::jetstream::consumer::{self, DeliverPolicy};
use futures::StreamExt;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::{subjects, SessionId};

#[derive(clap::Args)]
pub struct EventsArgs {
    /// Only this session's events.
    #[arg(long)]
    pub session: Option<SessionId>,
    /// Start from the oldest kept event instead of now.
    #[arg(long)]
    pub replay: bool,
    /// Exit once caught up instead of following.
    #[arg(long)]
    pub no_follow: bool,
    /// One JSON envelope per line.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(url: &str, args: EventsArgs) -> anyhow::Result<ExitCode> {
    let client = turnstile_shared::config::connect_once(url, "turnstile-events").await?;
    follow(&client, &args, &mut std::io::stdout()).await?;
    Ok(ExitCode::SUCCESS)
}

/// Writes events to `out` until the stream ends (or, with `no_follow`, until caught up).
pub async fn follow(
    client: &async_nats::Client,
    args: &EventsArgs,
    out: &mut (dyn Write + Send),
) -> anyhow::Result<()> {
    let js = async_nats::jetstream::new(client.clone());
    let stream = js
        .get_stream(subjects::EVENTS_STREAM)
        .await
        .context("open the events stream (has any Turnstile service run against this NATS?)")?;
    let filter = match &args.session {
        Some(s) => subjects::session_events(s),
        None => subjects::EVENTS_ALL.to_string(),
    };
    let deliver_policy = if args.replay {
        DeliverPolicy::All
    } else {
        DeliverPolicy::New
    };
    let mut consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: filter,
            deliver_policy,
            ..Default::default()
        })
        .await
        .context("create events consumer")?;
    if args.no_follow && consumer.info().await.map(|i| i.num_pending).unwrap_or(0) == 0 {
        return Ok(());
    }
    let mut messages = consumer.messages().await.context("follow events")?;
    while let Some(msg) = messages.next().await {
        let msg = msg.context("events stream")?;
        match Envelope::decode(&msg.payload) {
            Ok(env) if args.json => writeln!(out, "{}", serde_json::to_string(&env)?)?,
            Ok(env) => writeln!(out, "{}", human(&env))?,
            Err(e) => writeln!(out, "unreadable event on {}: {e}", msg.subject)?,
        }
        out.flush()?;
        if args.no_follow && msg.info().map(|i| i.pending).unwrap_or(0) == 0 {
            break;
        }
    }
    Ok(())
}

/// `12:00:01.250  ses_…  trn_…  turn.completed  details`.
pub fn human(env: &Envelope) -> String {
    let d = &env.data;
    let s = |k: &str| {
        d.get(k)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    };
    let detail = match env.kind.parse::<EventKind>() {
        Ok(EventKind::SessionCreated) => {
            format!("{} agent={} host={}", s("name"), s("agent"), s("host"))
        }
        Ok(EventKind::TurnQueued) => format!("{:?}", first_line(&s("text"))),
        Ok(EventKind::TurnStarted) => format!("host={} replica={}", s("host"), s("replica")),
        Ok(EventKind::TurnCompleted) => d
            .get("output")
            .and_then(|o| o.as_array())
            .and_then(|o| {
                o.iter()
                    .rev()
                    .find_map(|l| l.as_str().filter(|l| !l.trim().is_empty()))
            })
            .map(|l| format!("{:?}", first_line(l)))
            .unwrap_or_default(),
        Ok(EventKind::TurnFailed) => format!("{}: {}", s("reason"), s("detail")),
        Ok(EventKind::LaneRejected) => s("reason"),
        Ok(EventKind::TerminalReady) => {
            format!("host={} conversation={}", s("host"), s("conversation"))
        }
        _ => String::new(),
    };
    let id = |o: Option<String>| o.unwrap_or_else(|| "-".to_string());
    format!(
        "{}  {:<36}  {:<36}  {:<15} {}",
        env.at.format("%H:%M:%S%.3f"),
        id(env
            .session
            .as_ref()
            .map(|s| s.to_string())
            .or(env.host.as_ref().map(|h| format!("host {h}")))),
        id(env.turn.as_ref().map(|t| t.to_string())),
        env.kind,
        detail
    )
}

fn first_line(s: &str) -> String {
    s.lines()
        .next()
        .unwrap_or_default()
        .chars()
        .take(70)
        .collect()
}
