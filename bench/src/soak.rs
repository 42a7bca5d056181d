//! `turnstile-bench soak --minutes N`: the services as processes (see `procs`) on a deployment
//! provisioned with a short record retention, and `SESSIONS` sessions turning without pause:
//! each sends a turn that starts an `external` step (worked by this benchmark, which reports it
//! done at once, so its completion is handed over in a delivery turn), and `SCHEDULES`
//! schedules fire every ten seconds. Every `interval` the resident memory of each process and
//! the store's bytes are sampled; the samples are printed as JSON and drawn into a PNG
//! (`plot`). With state bounded, memory and store size stop growing once the first retention
//! window has passed.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use futures::StreamExt;
use plotters::prelude::{BitMapBackend, IntoDrawingArea, WHITE};
use tokio_util::sync::CancellationToken;
use turnstile_shared::api::{self, ErrorCode, SendTurn};
use turnstile_shared::envelope::Envelope;
use turnstile_shared::execution::{ExecutionRecord, Scope, StepResult};
use turnstile_shared::principal::Principal;
use turnstile_shared::records::{SessionRecord, TurnRecord, TurnState};
use turnstile_shared::schedules::{ScheduleRecord, ScheduleSpec};
use turnstile_shared::step_api::{
    Caller, Report, ReportAck, StartStep, StepKind, StepReport, StepWorkItem,
};
use turnstile_shared::subjects::{self, api as subj};
use turnstile_shared::topology::{self, TopologyConfig};
use turnstile_shared::SessionId;

use crate::deployment::Deployment;
use crate::inproc::create_sessions;
use crate::procs::{rss_all, Services};

const SESSIONS: usize = 100;
const SCHEDULES: usize = 10;
const QUEUE: &str = "soak";
const CALL: Duration = Duration::from_secs(10);

/// One sample: seconds since the start, each process's resident memory, the store's bytes.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    pub at_s: f64,
    pub rss_kb: Vec<(&'static str, u64)>,
    pub store_bytes: u64,
    pub turns_sent: u64,
    pub steps_done: u64,
}

pub async fn measure(
    d: &Deployment,
    topology: &TopologyConfig,
    minutes: f64,
    png: &std::path::Path,
) -> Result<serde_json::Value> {
    let client = Deployment::connect(&d.operator).await?;
    let js = async_nats::jetstream::new(client.clone());
    let services = Services::start(d)?;
    let procs = services.pids(d);
    let sessions = create_sessions(&client, SESSIONS).await?;
    let kv = js.get_key_value(subjects::SESSIONS_BUCKET).await?;
    let mut callers = Vec::with_capacity(sessions.len());
    for s in &sessions {
        let rec: SessionRecord =
            serde_json::from_slice(&kv.get(s.as_str()).await?.context("session record")?)?;
        callers.push(Caller {
            session: Some(s.clone()),
            step: None,
            token: rec.token,
        });
    }
    for (i, s) in sessions.iter().take(SCHEDULES).enumerate() {
        let spec: ScheduleSpec = serde_json::from_value(serde_json::json!({
            "name": format!("soak-{i}"), "cron": "*/10 * * * * *", "tz": "UTC",
            "session": s, "messages": ["scheduled soak run"],
        }))?;
        let _: ScheduleRecord = api::call(&client, subj::SCHEDULES_ADD, &spec, CALL).await?;
    }

    let stop = CancellationToken::new();
    let turns = Arc::new(AtomicU64::new(0));
    let steps = Arc::new(AtomicU64::new(0));
    let worker = tokio::spawn(work_steps(client.clone(), stop.clone(), steps.clone()));
    let drivers: Vec<_> = callers
        .into_iter()
        .map(|c| tokio::spawn(drive(client.clone(), c, stop.clone(), turns.clone())))
        .collect();

    let total = Duration::from_secs_f64(minutes * 60.0);
    let interval = (total / 40).clamp(Duration::from_secs(5), Duration::from_secs(30));
    let started = Instant::now();
    let mut samples = Vec::new();
    loop {
        let account = js.query_account().await?;
        samples.push(Sample {
            at_s: (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
            rss_kb: rss_all(&procs)?,
            store_bytes: account.storage + account.memory,
            turns_sent: turns.load(Ordering::Relaxed),
            steps_done: steps.load(Ordering::Relaxed),
        });
        if let Some(s) = samples.last() {
            eprintln!("soak: {s:?}");
        }
        if started.elapsed() >= total {
            break;
        }
        tokio::time::sleep(interval.min(total.saturating_sub(started.elapsed()))).await;
    }
    let by_stream = store_by_stream(&js).await?;
    stop.cancel();
    for d in drivers {
        let _ = d.await;
    }
    let _ = worker.await;
    drop(services);
    // The first full window: the longest any finished record is kept.
    let window = topology.record_retention + topology.tree_margin;
    draw(png, &samples, window)?;
    Ok(serde_json::json!({
        "sessions": SESSIONS,
        "schedules": SCHEDULES,
        "minutes": minutes,
        "record_retention_s": topology.record_retention.as_secs(),
        "tree_margin_s": topology.tree_margin.as_secs(),
        "events_max_age_s": topology.events_max_age.as_secs(),
        "plot": png,
        "level_after_first_window": level(&samples, window),
        "store_by_stream_at_end": by_stream,
        "samples": samples,
    }))
}

/// Each stream's bytes and messages.
async fn store_by_stream(js: &async_nats::jetstream::Context) -> Result<serde_json::Value> {
    let mut out = serde_json::Map::new();
    let mut names = js.stream_names();
    while let Some(name) = names.next().await {
        let name = name?;
        let mut stream = js.get_stream(&name).await?;
        let state = &stream.info().await?.state;
        out.insert(
            name,
            serde_json::json!({ "bytes": state.bytes, "messages": state.messages }),
        );
    }
    Ok(serde_json::Value::Object(out))
}

/// Growth after the first retention window (`window`: the longest a finished record is
/// kept): each series' peak over the second half of the samples taken after it against its
/// peak over the first half (1.0 = flat).
fn level(samples: &[Sample], window: Duration) -> serde_json::Value {
    let after: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.at_s >= window.as_secs_f64())
        .collect();
    let half = after.len() / 2;
    if half == 0 {
        return serde_json::json!("too short: run past twice the retention and tree margin");
    }
    let peak =
        |xs: &[&Sample], f: &dyn Fn(&Sample) -> u64| xs.iter().map(|s| f(s)).max().unwrap_or(0);
    let ratio = |f: &dyn Fn(&Sample) -> u64| {
        let (a, b) = (peak(&after[..half], f), peak(&after[half..], f));
        ((b as f64 / a.max(1) as f64) * 100.0).round() / 100.0
    };
    let mut out = serde_json::Map::new();
    out.insert("store_bytes".into(), ratio(&|s| s.store_bytes).into());
    if let Some(first) = samples.first() {
        for (i, (name, _)) in first.rss_kb.iter().enumerate() {
            out.insert(
                format!("{name}_rss"),
                ratio(&|s| s.rss_kb.get(i).map_or(0, |r| r.1)).into(),
            );
        }
    }
    serde_json::Value::Object(out)
}

/// One session's loop: a turn that holds the lane briefly and starts a step from inside it.
async fn drive(
    client: async_nats::Client,
    caller: Caller,
    stop: CancellationToken,
    turns: Arc<AtomicU64>,
) {
    let Some(session) = caller.session.clone() else {
        return;
    };
    let mut n = 0u64;
    while !stop.is_cancelled() {
        n += 1;
        if let Err(e) = cycle(&client, &caller, &session, n).await {
            eprintln!("soak: session {session}: {e:#}");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        turns.fetch_add(1, Ordering::Relaxed);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

async fn cycle(
    client: &async_nats::Client,
    caller: &Caller,
    session: &SessionId,
    n: u64,
) -> Result<()> {
    let send = SendTurn {
        session: session.clone(),
        text: format!("soak turn {n}\n!sleep 400ms"),
        turn: None,
    };
    let sent: TurnRecord = api::call(client, subj::SESSION_SEND, &send, CALL).await?;
    let sent_back = chrono::Utc::now();
    let req = StartStep {
        caller: caller.clone(),
        name: format!("soak-{n}"),
        scope: Scope::Turn,
        work: StepKind::External {
            queue: QUEUE.into(),
            input: serde_json::Value::Null,
        },
        id: None,
    };
    let subject = Principal::of(caller).steps(subj::START);
    // The turn starts once it holds the lane (behind a delivery turn, maybe).
    let deadline = Instant::now() + Duration::from_secs(10);
    // Kept for a refusal's message: when the tries were made and how long the slowest took.
    let (mut tries, mut slowest) = (0u32, Duration::ZERO);
    let mut first_answer = None;
    loop {
        let at = Instant::now();
        let answer = api::call::<_, ExecutionRecord>(client, &subject, &req, CALL).await;
        tries += 1;
        slowest = slowest.max(at.elapsed());
        first_answer.get_or_insert_with(chrono::Utc::now);
        match answer {
            Ok(_) => return Ok(()),
            Err(e) if e.code == ErrorCode::NoTurn && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) if e.code == ErrorCode::NoTurn => {
                let state = turn_state(client, &sent).await;
                let now = chrono::Utc::now();
                let first = first_answer.map_or_else(String::new, |t| t.to_string());
                return Err(anyhow::anyhow!(
                    "{e} (at {now}; its turn {}, queued {}, sent back {sent_back}: {state}; \
                     {tries} tries, the first answered {first}, the slowest {slowest:?})",
                    sent.id,
                    sent.queued_at
                ));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// What became of a turn whose step start was refused `no_turn` until the deadline: read
/// back so the soak's log says why (it ended before any start got in, or never ran).
async fn turn_state(client: &async_nats::Client, sent: &TurnRecord) -> String {
    let js = async_nats::jetstream::new(client.clone());
    let record = match js.get_key_value(subjects::TURNS_BUCKET).await {
        Ok(kv) => kv.get(sent.id.as_str()).await,
        Err(e) => return format!("turns bucket: {e}"),
    };
    match record {
        Ok(Some(bytes)) => match serde_json::from_slice::<TurnRecord>(&bytes) {
            Ok(r) => match r.state {
                TurnState::Queued => "still queued".into(),
                TurnState::Running { typed_at, .. } => format!("running since {typed_at}"),
                TurnState::Completed {
                    typed_at, ended_at, ..
                } => format!("completed, typed {typed_at}, ended {ended_at}"),
                TurnState::Failed {
                    ended_at, reason, ..
                } => format!("failed {reason} at {ended_at}"),
            },
            Err(e) => format!("unreadable record: {e}"),
        },
        Ok(None) => "no record".into(),
        Err(e) => format!("read: {e}"),
    }
}

/// The `external` worker: takes each step's work and reports it done at once.
async fn work_steps(
    client: async_nats::Client,
    stop: CancellationToken,
    done: Arc<AtomicU64>,
) -> Result<()> {
    let js = async_nats::jetstream::new(client.clone());
    let consumer =
        topology::ensure_step_external_consumer(&js, &TopologyConfig::default(), QUEUE).await?;
    let mut messages = consumer.messages().await?;
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            m = messages.next() => match m { Some(Ok(m)) => m, _ => return Ok(()) },
        };
        let Ok(item) = Envelope::decode(&msg.payload).and_then(|e| e.data_as::<StepWorkItem>())
        else {
            let _ = msg.ack().await;
            continue;
        };
        let result = StepResult {
            exit_code: Some(0),
            summary: "done".into(),
            output: vec![],
        };
        for report in [
            Report::Started {
                worker: "soak".into(),
            },
            Report::Completed { result },
        ] {
            let req = StepReport {
                step: item.step.clone(),
                token: item.token.clone(),
                report,
            };
            let subject = Principal::Step(item.step.clone()).steps(subj::REPORT);
            if let Err(e) = api::call::<_, ReportAck>(&client, &subject, &req, CALL).await {
                eprintln!("soak: report {}: {e}", item.step);
            }
        }
        let _ = msg.double_ack().await;
        done.fetch_add(1, Ordering::Relaxed);
    }
}

/// The soak's PNG: resident memory of each process (MB) and the store's size (MB) over time,
/// with the end of the first retention window (record retention plus tree margin) marked.
fn draw(path: &Path, samples: &[Sample], window: Duration) -> Result<()> {
    let labels = crate::plot::register_font();
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
    crate::plot::panel(
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
    crate::plot::panel(&bottom, "store (MB)", &mut store, end, Some(window), labels)?;
    root.present()
        .map_err(|e| anyhow!("write {}: {e}", path.display()))?;
    Ok(())
}
