//! Consumes this host's transport commands (`start`, `turn`, `stop`). A turn is recorded as
//! `running` (an acknowledged KV write) before a single key is typed, and its command is acked
//! only once the outcome is recorded, so a redelivered command never types twice (R14).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use chrono::Utc;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::{self, host_event, session_event, EventKind};
use turnstile_shared::kv::Change;
use turnstile_shared::records::{
    reason, transport_kind, SessionRecord, StartCommand, StopCommand, TurnCommand, TurnRecord,
    TurnState,
};
use turnstile_shared::{consume, deadletter, subjects, topology, SessionId, TurnId};

use crate::adapter::{Adapter, Adopted, SessionSpec, TurnEnd};
use crate::ctx::{Ctx, Error};

pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) -> Result<(), Error> {
    consume::until_shutdown("transport commands", &shutdown, || consume(&ctx, &shutdown)).await;
    Ok(())
}

async fn consume(ctx: &Arc<Ctx>, shutdown: &CancellationToken) -> Result<(), async_nats::Error> {
    let consumer =
        topology::ensure_transport_consumer(&ctx.js, &ctx.config.topology, &ctx.config.host)
            .await?;
    consume::each_message(consumer, shutdown, |msg| handle(ctx.clone(), msg)).await
}

async fn handle(ctx: Arc<Ctx>, msg: jetstream::Message) {
    let env = match Envelope::decode(&msg.payload) {
        Ok(env) => env,
        Err(e) => return refuse(&ctx, &msg, &e.to_string()).await,
    };
    let result = match env.kind.as_str() {
        transport_kind::TURN => match env.data_as::<TurnCommand>() {
            Ok(cmd) => return handle_turn(&ctx, msg, cmd).await,
            Err(e) => Err(e.to_string()),
        },
        transport_kind::START => match env.data_as::<StartCommand>() {
            Ok(cmd) => {
                handle_start(&ctx, &cmd.session).await;
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        },
        transport_kind::STOP => match env.data_as::<StopCommand>() {
            Ok(cmd) => {
                handle_stop(&ctx, &cmd.session).await;
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        },
        other => Err(format!("unknown transport command {other:?}")),
    };
    match result {
        Ok(()) => {
            let _ = msg.double_ack().await;
        }
        Err(reason) => refuse(&ctx, &msg, &reason).await,
    }
}

/// R15: a command this build cannot read is dead-lettered with the reason and an event; the
/// host's other commands go on.
pub(crate) async fn refuse(ctx: &Ctx, msg: &jetstream::Message, reason: &str) {
    let host = &ctx.config.host;
    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or_default();
    let dlq = subjects::transport_deadletter(host);
    let event = host_event(
        EventKind::TransportRejected,
        host,
        &json!({ "reason": reason, "subject": msg.subject.as_str(), "dead_letter": dlq }),
    )
    .map(|e| e.with_id(format!("{host}:transport.rejected:{seq}")));
    match event {
        Ok(event) => deadletter::refuse(&ctx.js, msg, dlq, reason, &event).await,
        Err(e) => tracing::error!(%host, error = %e, "build transport.rejected"),
    }
}

async fn spec_for(ctx: &Ctx, session: &SessionId) -> Option<(SessionSpec, bool)> {
    let stops = {
        let Ok(map) = ctx.sessions.lock() else {
            return None;
        };
        if let Some(spec) = map.get(session) {
            return Some((spec.clone(), true));
        }
        ctx.stops.load(Ordering::Acquire)
    };
    let record = match ctx
        .buckets
        .sessions
        .get::<SessionRecord>(session.as_str())
        .await
    {
        Ok(Some((r, _))) => r,
        Ok(None) => return None,
        Err(e) => {
            tracing::warn!(%session, error = %e, "read session");
            return None;
        }
    };
    let active = record.is_active();
    let spec = SessionSpec {
        id: record.id.clone(),
        agent: record.agent,
        cwd: record.cwd.map(Into::into),
        conversation: record.conversation,
        token: record.token,
        launch: record.launch,
        ready_timeout: record.ready_timeout_ms.map(Duration::from_millis),
        policy: record.policy,
    };
    if active {
        if let Ok(mut map) = ctx.sessions.lock() {
            // A stop handled since the read may be this session's: not cached then (the
            // next turn reads the record again).
            if ctx.stops.load(Ordering::Acquire) == stops {
                map.insert(session.clone(), spec.clone());
            }
        }
    }
    Some((spec, active))
}

fn adapter(ctx: &Ctx, spec: &SessionSpec) -> Option<Arc<dyn Adapter>> {
    ctx.adapters.get(&spec.agent).cloned()
}

/// Whether the session's record says it stopped (read when a turn failed, to name why).
async fn is_stopped(ctx: &Ctx, session: &SessionId) -> bool {
    match ctx
        .buckets
        .sessions
        .get::<SessionRecord>(session.as_str())
        .await
    {
        Ok(Some((r, _))) => !r.is_active(),
        Ok(None) => true,
        Err(e) => {
            tracing::debug!(%session, error = %e, "read session");
            false
        }
    }
}

/// Launches (or resumes) the agent if needed; one launch per session at a time.
async fn ensure_ready(ctx: &Ctx, spec: &SessionSpec) -> Result<(), TurnEnd> {
    let Some(adapter) = adapter(ctx, spec) else {
        return Err(TurnEnd::Failed {
            reason: reason::TRANSPORT_ERROR,
            detail: format!(
                "host {} has no adapter for agent {}",
                ctx.config.host, spec.agent
            ),
            output: Vec::new(),
        });
    };
    let lock = {
        let mut locks = match ctx.launch_locks.lock() {
            Ok(l) => l,
            Err(p) => p.into_inner(),
        };
        locks.entry(spec.id.clone()).or_default().clone()
    };
    let _guard = lock.lock().await;
    let ready_timeout = spec.ready_timeout.unwrap_or(ctx.config.ready_timeout);
    match adapter.ensure_ready(spec, ready_timeout).await {
        Ok(ready) => {
            if ready.conversation.is_some() && ready.conversation != spec.conversation {
                remember_conversation(ctx, spec, ready.conversation.clone()).await;
            }
            if ready.launched {
                let ev = session_event(
                    EventKind::TerminalReady,
                    &spec.id,
                    None,
                    &json!({ "host": ctx.config.host, "conversation": ready.conversation }),
                )
                .map(|e| e.with_id(uuid::Uuid::now_v7().simple().to_string()));
                if let Ok(ev) = ev {
                    let _ = events::publish(&ctx.js, &ev).await;
                }
            }
            Ok(())
        }
        Err(u) => Err(TurnEnd::Failed {
            reason: reason::PARENT_TRANSPORT_UNAVAILABLE,
            detail: format!(
                "host {}, terminal {}: {}",
                ctx.config.host, spec.id, u.detail
            ),
            output: u.last_lines,
        }),
    }
}

async fn remember_conversation(
    ctx: &Ctx,
    spec: &SessionSpec,
    conversation: Option<turnstile_shared::ConversationId>,
) {
    if let Ok(mut map) = ctx.sessions.lock() {
        if let Some(s) = map.get_mut(&spec.id) {
            s.conversation = conversation.clone();
        }
    }
    let r = ctx
        .buckets
        .sessions
        .modify::<SessionRecord, _>(spec.id.as_str(), |cur| match cur {
            Some(r) if r.conversation != conversation => Change::Write(SessionRecord {
                conversation: conversation.clone(),
                ..r.clone()
            }),
            _ => Change::Keep,
        })
        .await;
    if let Err(e) = r {
        tracing::warn!(session = %spec.id, error = %e, "record conversation id");
    }
}

async fn handle_start(ctx: &Ctx, session: &SessionId) {
    let Some((spec, true)) = spec_for(ctx, session).await else {
        return;
    };
    if let Err(TurnEnd::Failed { detail, .. }) = ensure_ready(ctx, &spec).await {
        tracing::warn!(%session, detail, "agent not ready after start; the next turn retries");
    }
}

async fn handle_stop(ctx: &Ctx, session: &SessionId) {
    let spec = spec_for(ctx, session).await.map(|(s, _)| s);
    if let Ok(mut map) = ctx.sessions.lock() {
        ctx.stops.fetch_add(1, Ordering::AcqRel);
        map.remove(session);
    }
    if let Ok(mut locks) = ctx.launch_locks.lock() {
        locks.remove(session);
    }
    if let Some(spec) = spec {
        if let Some(adapter) = adapter(ctx, &spec) {
            adapter.stop(&spec).await;
        }
    }
}

/// Forgets a turn as active when its handler ends, however it ends.
struct ActiveGuard<'a> {
    ctx: &'a Ctx,
    turn: TurnId,
}

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut a) = self.ctx.active.lock() {
            a.remove(&self.turn);
        }
    }
}

async fn handle_turn(ctx: &Ctx, msg: jetstream::Message, cmd: TurnCommand) {
    let inserted = ctx
        .active
        .lock()
        .map(|mut a| a.insert(cmd.turn.clone()))
        .unwrap_or(false);
    if !inserted {
        // A redelivery of a turn this process is still running: its handler will ack.
        return;
    }
    let _guard = ActiveGuard {
        ctx,
        turn: cmd.turn.clone(),
    };
    let period = ctx.config.topology.progress_interval();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    // A command delivered again (a transport that died mid-turn, a lost ack) may carry what
    // its lane knew before this turn ran: the record is read.
    let first_delivery = msg.info().map(|i| i.delivered <= 1).unwrap_or(false);
    let work = drive_turn(ctx, &cmd, first_delivery);
    tokio::pin!(work);
    let outcome = loop {
        tokio::select! {
            out = &mut work => break out,
            _ = tick.tick() => {
                if let Err(e) = msg.ack_with(AckKind::Progress).await {
                    tracing::debug!(turn = %cmd.turn, error = %e, "progress ack");
                }
            }
        }
    };
    match outcome {
        // Not confirmed: a command whose ack is lost comes back, finds its turn ended and is
        // only acked again.
        Ok(()) => {
            if let Err(e) = msg.ack().await {
                tracing::warn!(turn = %cmd.turn, error = %e, "ack turn command");
            }
        }
        Err(e) => {
            tracing::warn!(turn = %cmd.turn, error = %e, "turn command; will retry");
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_millis(500))))
                .await;
        }
    }
}

/// Runs the turn to a recorded outcome. `Err` means nothing durable happened yet: retry.
async fn drive_turn(
    ctx: &Ctx,
    cmd: &TurnCommand,
    first_delivery: bool,
) -> Result<(), turnstile_shared::kv::KvError> {
    // The lane's word for the record, when it says it stands queued at a revision and this is
    // the command's first delivery: recorded running over that revision with no read first. A
    // record that moved on meanwhile makes that write lose before anything is typed, and the
    // turn is driven from a read instead. (Getting the agent ready comes before that write:
    // on a redelivery the turn may be running in the agent, so the record is read first.)
    // Or the lane wrote no record (a delivery turn): created running, with no read first.
    let known = cmd.known.as_ref().filter(|k| {
        k.record.id == cmd.turn
            && k.record.session == cmd.session
            && k.record.state == TurnState::Queued
    });
    let unread = match known {
        Some(k) => Some((k.record.clone(), Base::At(k.revision))),
        None if cmd.unrecorded => Some((from_command(cmd), Base::Absent)),
        None => None,
    };
    if let Some((record, base)) = unread.filter(|_| first_delivery) {
        if let Driven::Done = drive_from(ctx, cmd, record, base).await? {
            return Ok(());
        }
    }
    let (record, revision) = current(ctx, cmd).await?;
    match drive_from(ctx, cmd, record, Base::At(revision)).await? {
        Driven::Done => Ok(()),
        // Someone else moved the turn on; start over from what is recorded then.
        Driven::Moved => Err(turnstile_shared::kv::KvError::Contended {
            bucket: subjects::TURNS_BUCKET.to_string(),
            key: cmd.turn.to_string(),
            attempts: 1,
        }),
    }
}

/// How far [`drive_from`] took a turn.
enum Driven {
    /// Its outcome is recorded (or it was not this transport's to run).
    Done,
    /// The record was not where [`drive_from`] was told it stood when the transport came to
    /// record it running: nothing was typed.
    Moved,
}

/// Where the turn's record stands for [`drive_from`]'s write of it running.
#[derive(Clone, Copy)]
enum Base {
    /// At this revision: recorded running by compare-and-set.
    At(u64),
    /// Not written: recorded running by a create.
    Absent,
}

/// The turn's record as its command describes it, queued: what the transport records when
/// no record is there (a delivery turn's carried list included).
fn from_command(cmd: &TurnCommand) -> TurnRecord {
    TurnRecord::queued(cmd.turn.clone(), cmd.session.clone(), cmd.text.clone())
        .carrying(cmd.delivery.clone())
}

/// The turn's record and revision: read, or created from the command when the lane's write
/// has not landed yet.
async fn current(
    ctx: &Ctx,
    cmd: &TurnCommand,
) -> Result<(TurnRecord, u64), turnstile_shared::kv::KvError> {
    let key = cmd.turn.as_str();
    if let Some(found) = ctx.buckets.turns.get::<TurnRecord>(key).await? {
        return Ok(found);
    }
    // A delivery turn's record is the transport's to write (or, from an older lane, its
    // command overtook the lane's write of the same record, whichever lands first).
    let fresh = from_command(cmd);
    match ctx.buckets.turns.create(key, &fresh).await? {
        Some(revision) => Ok((fresh, revision)),
        // Created meanwhile by the lane (a redelivery): read what it wrote. Absent again
        // means it was deleted between the two: retry, never drop the command.
        None => ctx
            .buckets
            .turns
            .get::<TurnRecord>(key)
            .await?
            .ok_or_else(|| turnstile_shared::kv::KvError::Contended {
                bucket: subjects::TURNS_BUCKET.to_string(),
                key: key.to_string(),
                attempts: 1,
            }),
    }
}

/// Runs the turn from its record as it stood at `base`.
async fn drive_from(
    ctx: &Ctx,
    cmd: &TurnCommand,
    record: TurnRecord,
    base: Base,
) -> Result<Driven, turnstile_shared::kv::KvError> {
    let key = cmd.turn.as_str();
    if record.state.is_terminal() {
        return Ok(Driven::Done);
    }
    if record.session != cmd.session {
        let detail = format!(
            "turn {} belongs to session {}, not {}",
            record.id, record.session, cmd.session
        );
        tracing::warn!(detail, "refusing turn command");
        return Ok(Driven::Done);
    }
    let (spec, adapter) = match turn_target(ctx, cmd).await {
        Ok(t) => t,
        Err(end) => return record_end(ctx, &record, end).await.map(|()| Driven::Done),
    };
    let mut written = None;
    let end = match &record.state {
        // Typed by an earlier run of this transport: watch it to its end, never type again.
        // Recorded by an earlier run of this transport: watch it to its end, and type it only
        // if the terminal shows it never went in (R14: never twice).
        TurnState::Running { mark, .. } => {
            match adapter
                .await_turn(&spec, *mark, ctx.config.turn_timeout)
                .await
            {
                Adopted::Ended(end) => end,
                Adopted::NotTyped => {
                    tracing::info!(turn = %cmd.turn, "re-adopted turn was never typed; typing it now");
                    adapter
                        .run_turn(&spec, &record.text, *mark, ctx.config.turn_timeout)
                        .await
                }
            }
        }
        _ => {
            if let Err(end) = ensure_ready(ctx, &spec).await {
                return record_end(ctx, &record, end).await.map(|()| Driven::Done);
            }
            let mark = match adapter.mark(&spec).await {
                Ok(m) => m,
                Err(end) => return record_end(ctx, &record, end).await.map(|()| Driven::Done),
            };
            let running = TurnRecord {
                state: TurnState::Running {
                    host: ctx.config.host.clone(),
                    typed_at: Utc::now(),
                    mark,
                },
                ..record.clone()
            };
            let stored = match base {
                Base::At(revision) => ctx.buckets.turns.update(key, &running, revision).await?,
                Base::Absent => ctx.buckets.turns.create(key, &running).await?,
            };
            let Some(rev) = stored else {
                return Ok(Driven::Moved);
            };
            written = Some((running, rev));
            adapter
                .run_turn(&spec, &record.text, mark, ctx.config.turn_timeout)
                .await
        }
    };
    let end = match end {
        TurnEnd::Failed { output, .. } if is_stopped(ctx, &cmd.session).await => TurnEnd::Failed {
            reason: reason::SESSION_STOPPED,
            detail: "the session was stopped during the turn".into(),
            output,
        },
        other => other,
    };
    record_end_from(ctx, &record, written, end)
        .await
        .map(|()| Driven::Done)
}

/// The session and adapter a turn goes to, or why it cannot go anywhere.
async fn turn_target(
    ctx: &Ctx,
    cmd: &TurnCommand,
) -> Result<(SessionSpec, Arc<dyn Adapter>), TurnEnd> {
    let Some((spec, active)) = spec_for(ctx, &cmd.session).await else {
        return Err(failed(
            reason::TRANSPORT_ERROR,
            format!("no session {}", cmd.session),
        ));
    };
    if !active {
        return Err(failed(
            reason::SESSION_STOPPED,
            "the session is stopped".into(),
        ));
    }
    match adapter(ctx, &spec) {
        Some(a) => Ok((spec, a)),
        None => Err(failed(
            reason::TRANSPORT_ERROR,
            format!("no adapter for agent {}", spec.agent),
        )),
    }
}

fn failed(reason: &'static str, detail: String) -> TurnEnd {
    TurnEnd::Failed {
        reason,
        detail,
        output: Vec::new(),
    }
}

/// Writes the outcome unless another writer already ended the turn.
async fn record_end(
    ctx: &Ctx,
    record: &TurnRecord,
    end: TurnEnd,
) -> Result<(), turnstile_shared::kv::KvError> {
    record_end_from(ctx, record, None, end).await
}

/// `known`: the record as this process last wrote it, with its revision (saves a read).
async fn record_end_from(
    ctx: &Ctx,
    record: &TurnRecord,
    known: Option<(TurnRecord, u64)>,
    end: TurnEnd,
) -> Result<(), turnstile_shared::kv::KvError> {
    let ended_at = Utc::now();
    let host = ctx.config.host.clone();
    ctx.buckets
        .turns
        .modify_from::<TurnRecord, _>(record.id.as_str(), known, |cur| {
            let base = cur.unwrap_or(record);
            if base.state.is_terminal() {
                return Change::Keep;
            }
            let typed_at = match &base.state {
                TurnState::Running { typed_at, .. } => *typed_at,
                _ => ended_at,
            };
            let state = match &end {
                TurnEnd::Completed { output } => TurnState::Completed {
                    host: host.clone(),
                    typed_at,
                    ended_at,
                    output: output.clone(),
                },
                TurnEnd::Failed {
                    reason,
                    detail,
                    output,
                } => TurnState::Failed {
                    ended_at,
                    reason: reason.to_string(),
                    detail: detail.clone(),
                    output: output.clone(),
                },
            };
            Change::Write(TurnRecord {
                state,
                ..base.clone()
            })
        })
        .await
        .map(|_| ())
}
