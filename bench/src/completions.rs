//! Completion-to-agent latency with an idle lane: from a worker reporting a step's end to the
//! lane dispatching the delivery turn that carries it to the transport (when its
//! `turn.started` event, sent with the transport command, reaches the benchmark). Path: report
//! API, the broker's ended queue, the registry write, the completion and the delivery item,
//! the lane taking it, collecting and checking the completion, dispatch. Beside it,
//! `to_running`: to the transport's write of the turn `running` (the server's time of that
//! write), right after which it types; this part includes the transport's work on the command.

use std::time::Duration;
use turnstile_shared::events::EventKind;
use turnstile_shared::principal::Principal;
use turnstile_shared::DeliveryId;

use anyhow::{bail, Context, Result};
use chrono::{SubsecRound, Utc};
use futures::StreamExt;
use turnstile_shared::api::{self, SendTurn, SessionRef, SessionView};
use turnstile_shared::envelope::Envelope;
use turnstile_shared::execution::{ExecutionRecord, Scope, StepResult};
use turnstile_shared::records::{SessionRecord, TurnRecord, TurnState};
use turnstile_shared::step_api::{
    Caller, Report, ReportAck, StartStep, StepKind, StepReport, StepWorkItem,
};
use turnstile_shared::subjects::{self, api as subj};
use turnstile_shared::topology::{self, TopologyConfig};

use crate::deployment::Deployment;
use crate::inproc::{create_sessions, start_broker, start_lane, start_transport};

const CALL: Duration = Duration::from_secs(10);
const WARMUP: usize = 20;

pub async fn measure(d: &Deployment, n: usize) -> Result<serde_json::Value> {
    let client = Deployment::connect(&d.operator).await?;
    let js = async_nats::jetstream::new(client.clone());
    let dir = tempfile::tempdir()?;
    let lane = start_lane(&d.lane);
    let broker = start_broker(&d.broker, d.callout.clone());
    let transport = start_transport(&d.transport, dir.path())?;
    let session = create_sessions(&client, 1).await?.remove(0);
    let kv = js.get_key_value(subjects::SESSIONS_BUCKET).await?;
    let record: SessionRecord =
        serde_json::from_slice(&kv.get(session.as_str()).await?.context("session")?)?;
    let caller = Caller {
        session: Some(session.clone()),
        step: None,
        token: record.token.clone(),
    };

    // One turn holds the lane while the steps are started (run scope: they outlive it).
    let holder: TurnRecord = api::call(
        &client,
        subj::SESSION_SEND,
        &SendTurn {
            session: session.clone(),
            text: "start the work\n!sleep 3s".into(),
            turn: None,
        },
        CALL,
    )
    .await?;
    let turns = js.get_key_value(subjects::TURNS_BUCKET).await?;
    let mut watch = turns.watch_with_history(">").await?;
    wait_turn(&mut watch, |r| {
        r.id == holder.id && matches!(r.state, TurnState::Running { .. })
    })
    .await?;
    let total = n + WARMUP;
    for i in 0..total {
        let req = StartStep {
            caller: caller.clone(),
            name: format!("bench-{i}"),
            scope: Scope::Session,
            work: StepKind::External {
                queue: "bench".into(),
                input: serde_json::Value::Null,
            },
            id: None,
        };
        let subject = Principal::of(&caller).steps(subj::START);
        let _: ExecutionRecord = api::call(&client, &subject, &req, CALL).await?;
    }
    // Take the work as an external worker would.
    let consumer =
        topology::ensure_step_external_consumer(&js, &TopologyConfig::default(), "bench").await?;
    let mut work = Vec::with_capacity(total);
    let mut messages = consumer.messages().await?;
    while work.len() < total {
        let msg = tokio::time::timeout(CALL, messages.next())
            .await
            .context("step work did not arrive")?
            .context("work stream ended")??;
        let item: StepWorkItem = Envelope::decode(&msg.payload)?.data_as()?;
        report(
            &client,
            &item,
            Report::Started {
                worker: "bench".into(),
            },
        )
        .await?;
        msg.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        work.push(item);
    }
    wait_turn(&mut watch, |r| r.id == holder.id && r.state.is_terminal())
        .await
        .context("the holding turn to end")?;
    wait_idle(&client, &session).await?;

    // Timed from a client on a thread and runtime of its own: on the services' runtime its
    // replies and events waited for a worker behind the services' tasks (a few hundred
    // microseconds a hop), which timed this process's scheduling, not the path.
    let url = d.operator.clone();
    let (floor_url, replicas) = (d.floor.clone(), d.replicas);
    let timer = std::thread::spawn(move || -> Result<serde_json::Value> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let floor = crate::floor::Floor::open(&floor_url, replicas).await?;
            sample(&url, &session, &work, n, floor).await
        })
    });
    let out = tokio::task::spawn_blocking(move || timer.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the timing thread panicked"))??;
    transport.stop().await;
    broker.stop().await;
    lane.stop().await;
    Ok(out)
}

/// Round trips of the floor measured before every this many samples (a block of
/// [`FLOOR_BLOCK`]), so the path is set beside the floor of the same minutes.
const FLOOR_EVERY: usize = 10;
const FLOOR_BLOCK: usize = 50;

/// The timed part: each step reported on an idle lane, until its delivery turn starts; the
/// floor in blocks between them (`floor_beside`).
async fn sample(
    url: &str,
    session: &turnstile_shared::SessionId,
    work: &[StepWorkItem],
    n: usize,
    mut floor: crate::floor::Floor,
) -> Result<serde_json::Value> {
    let client = Deployment::connect(url).await?;
    let js = async_nats::jetstream::new(client.clone());
    let turns = js.get_key_value(subjects::TURNS_BUCKET).await?;
    let mut watch = turns.watch(">").await?;
    let session = session.clone();
    let mut started = client.subscribe(subjects::session_events(&session)).await?;
    let mut samples = Vec::with_capacity(n);
    // Where the time goes (from event times, millisecond precision): report to recorded end,
    // end to delivery item, item to dispatch.
    let (mut ended_us, mut routed_us, mut lane_us) = (Vec::new(), Vec::new(), Vec::new());
    let mut running_us = Vec::new();
    let mut floor_us = Vec::new();
    for (i, item) in work.iter().enumerate() {
        if i >= WARMUP && (i - WARMUP).is_multiple_of(FLOOR_EVERY) {
            floor_us.extend(floor.warm_block(FLOOR_BLOCK).await?);
            wait_idle(&client, &session).await?;
        }
        let t0 = Utc::now();
        let result = StepResult {
            exit_code: Some(0),
            summary: "done".into(),
            output: vec![],
        };
        report(&client, item, Report::Completed { result }).await?;
        let step = item.step.to_string();
        // The delivery armed for this end names its turn (derived from the delivery id); its
        // `turn.started` is timed as it arrives, before anything later on the path (the
        // transport typing it and recording the turn running).
        let (mut recorded, mut queued, mut turn) = (None, None, None);
        // Turns seen starting before their delivery's event (events of two publishers may
        // arrive in either order).
        let mut early = Vec::new();
        let dispatched = loop {
            let msg = tokio::time::timeout(CALL, started.next())
                .await
                .context("no turn.started for the delivery")?
                .context("event subscription ended")?;
            let env = Envelope::decode(&msg.payload)?;
            match env.kind.parse::<EventKind>() {
                Ok(EventKind::StepCompleted)
                    if env.data["execution"].as_str() == Some(step.as_str()) =>
                {
                    recorded = Some(env.at)
                }
                // Envelope times are whole milliseconds: compared with t0 cut to its millisecond.
                Ok(EventKind::DeliveryQueued) if env.at >= t0.trunc_subsecs(3) => {
                    queued = Some(env.at);
                    turn = env.data["delivery"]
                        .as_str()
                        .and_then(|d| d.parse::<DeliveryId>().ok())
                        .map(|d| d.turn());
                    if let Some((_, at)) = early.iter().find(|(t, _)| turn.as_ref() == Some(t)) {
                        break *at;
                    }
                }
                // Received time: envelope times have millisecond precision.
                Ok(EventKind::TurnStarted) if turn.is_some() && env.turn == turn => {
                    break Utc::now()
                }
                Ok(EventKind::TurnStarted) => {
                    if let Some(t) = env.turn {
                        early.push((t, Utc::now()));
                    }
                }
                _ => {}
            }
        };
        // The turn timed is the one that carried this step's completion.
        let (delivery, written) = wait_turn(&mut watch, |r| {
            r.delivery
                .as_ref()
                .is_some_and(|d| d.completions.iter().any(|c| c.execution.as_str() == step))
                && !matches!(r.state, TurnState::Queued)
        })
        .await
        .with_context(|| format!("the delivery of {step} (step {} of {n})", i + 1))?;
        if Some(&delivery.id) != turn.as_ref() {
            bail!(
                "step {step} was carried by {} (expected the turn of the delivery armed for it)",
                delivery.id
            );
        }
        if i >= WARMUP {
            let us = |d: chrono::TimeDelta| d.num_microseconds().unwrap_or_default() as f64;
            samples.push(us(dispatched - t0));
            let t0_ns = t0.timestamp_nanos_opt().unwrap_or_default() as i128;
            running_us.push(((written - t0_ns) / 1000) as f64);
            if let (Some(r), Some(q)) = (recorded, queued) {
                ended_us.push(us(r - t0));
                routed_us.push(us(q - r));
                lane_us.push(us(dispatched - q));
            }
        }
        if !delivery.state.is_terminal() {
            wait_turn(&mut watch, |r| r.id == delivery.id && r.state.is_terminal())
                .await
                .context("the delivery turn to end")?;
        }
        wait_idle(&client, &session).await?;
    }
    let mut out = crate::stats::summary(samples);
    out["to_running"] = crate::stats::summary(running_us);
    out["floor_beside"] = crate::stats::summary(floor_us);
    out["stages_p50_us"] = serde_json::json!({
        "report_to_recorded_end": crate::stats::summary(ended_us)["p50_us"],
        "recorded_end_to_delivery_item": crate::stats::summary(routed_us)["p50_us"],
        "delivery_item_to_dispatch": crate::stats::summary(lane_us)["p50_us"],
    });
    Ok(out)
}

async fn report(client: &async_nats::Client, item: &StepWorkItem, report: Report) -> Result<()> {
    let req = StepReport {
        step: item.step.clone(),
        token: item.token.clone(),
        report,
    };
    let subject = Principal::Step(item.step.clone()).steps(subj::REPORT);
    let _: ReportAck = api::call(client, &subject, &req, CALL).await?;
    Ok(())
}

/// The first turn record change satisfying `pred`, and the server's time of that write (Unix
/// nanoseconds).
async fn wait_turn(
    watch: &mut async_nats::jetstream::kv::Watch,
    pred: impl Fn(&TurnRecord) -> bool,
) -> Result<(TurnRecord, i128)> {
    loop {
        let entry = tokio::time::timeout(CALL, watch.next())
            .await
            .context("no turn change within 10 s")?
            .context("turn watch ended")??;
        if let Ok(r) = serde_json::from_slice::<TurnRecord>(&entry.value) {
            if pred(&r) {
                return Ok((r, entry.created.unix_timestamp_nanos()));
            }
        }
    }
}

/// Until the lane has nothing in flight (so the next step ends on an idle lane, R1).
async fn wait_idle(
    client: &async_nats::Client,
    session: &turnstile_shared::SessionId,
) -> Result<()> {
    for _ in 0..1000 {
        let v: SessionView = api::call(
            client,
            subj::SESSION_SHOW,
            &SessionRef {
                session: session.clone(),
            },
            CALL,
        )
        .await?;
        if !v.busy && v.queued == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    bail!("the lane did not go idle")
}
