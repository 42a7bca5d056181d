//! One turn command driven to a recorded outcome: recorded `running` (compare-and-set, or a
//! create for a delivery turn) before a key is typed; a turn recorded running by an earlier
//! run of this transport is watched to its end and typed only if it never went in (R14).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use chrono::Utc;
use turnstile_shared::records::{reason, TurnCommand, TurnRecord, TurnState};
use turnstile_shared::{subjects, TurnId};

use super::record::{record_end, record_end_from};
use super::session::{adapter, ensure_ready, is_stopped, spec_for};
use crate::adapters::{Adapter, Adopted, SessionSpec, TurnEnd};
use crate::ctx::Ctx;

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

pub(super) async fn handle_turn(ctx: &Ctx, msg: jetstream::Message, cmd: TurnCommand) {
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
