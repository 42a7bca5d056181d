//! The backstop for a turn command lost after its publish was acknowledged.
//!
//! A lane sends its turn's command to the host's transport (`turn::dispatch`) and waits for
//! the outcome the transport records (`turn::wait_terminal`). On a cluster under overlapping
//! faults (a node's disk full while another is killed) an acknowledged message can be lost:
//! the fault campaign lost lane items, step items and a schedule write that way. A lost
//! command would leave the lane waiting for a turn nobody runs while its host heartbeats (a
//! host that stops heartbeating fails the turn instead, R9), and the session stuck behind it.
//!
//! So while it waits, the lane looks once the turn has gone untaken for
//! [`Config::lost_command_after`](crate::Config) (and again each such period): a turn whose
//! record is missing or still `queued` (a transport records it `running` before it types, R14)
//! and whose command is not stored on its host's queue past the transport consumer's ack floor
//! (the queue is a work queue: what is stored there is the work not yet done or being done)
//! gets its command sent again, under a message id of its own. The copy carries no word of
//! the record (no revision, not "unrecorded"), so the transport reads the record before it
//! does anything, and records the turn running only over what it read: a copy that finds the
//! turn taken types nothing (R1). The one case it cannot tell: the turn ran and its record's
//! `running` and outcome writes were lost by the store too (the record still reads `queued`);
//! then the copy types it again. Before this backstop the same loss held the lane for ever.
//!
//! Bounds: only while the host heartbeats (a lapsed host fails the turn instead), at most
//! [`MAX_AGAIN`] copies per wait (a command the transport refuses, say a wire version it
//! does not read, is dead-lettered and acked, and would otherwise be sent again for ever), and
//! the look itself within [`LOOK_BOUND`] (it runs in the wait's tick, which keeps the item
//! alive). A turn recorded `running` whose command is gone is not covered: a copy would go
//! through the transport's re-adoption of a running turn, which decides by the terminal
//! whether the text went in.

use std::time::Duration;

use tokio::time::Instant;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::records::TurnCommand;
use turnstile_shared::{events, subjects, work_queue, HostName, TurnId};

use crate::ctx::Ctx;

/// Stored commands read at most when looking for one (a host's queue is short; past this it
/// counts as there).
const SCAN: usize = 1_000;

/// Copies sent at most while one turn is waited on.
pub(crate) const MAX_AGAIN: u32 = 3;

/// How long one look may take (the wait's progress acks go out on the same tick).
const LOOK_BOUND: Duration = Duration::from_secs(2);

/// One waiting turn's watch over its command.
pub(crate) struct LostCommand<'a> {
    command: &'a Envelope,
    after: Duration,
    due: Instant,
    again: u32,
}

impl<'a> LostCommand<'a> {
    pub fn new(ctx: &Ctx, command: &'a Envelope) -> Self {
        let after = ctx.lost_command_after;
        Self {
            command,
            after,
            due: Instant::now() + after,
            again: 0,
        }
    }

    /// Called on the wait's ticks on which the host heartbeats, with whether the turn is still
    /// untaken (its record missing or `queued`). Sends the command again when it is due and
    /// the command is not stored.
    pub async fn check(&mut self, ctx: &Ctx, host: &HostName, turn: &TurnId, untaken: bool) {
        let now = Instant::now();
        if !untaken {
            self.due = now + self.after;
            return;
        }
        if now < self.due || self.again >= MAX_AGAIN {
            return;
        }
        self.due = now + self.after;
        match tokio::time::timeout(LOOK_BOUND, self.lost(ctx, host, turn)).await {
            Ok(Ok(true)) => self.send_again(ctx, host, turn).await,
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!(%turn, %host, error = %e, "look for a lost turn command"),
            Err(_) => {
                tracing::debug!(%turn, %host, "look for a lost turn command: no answer within {LOOK_BOUND:?}")
            }
        }
    }

    /// Whether the command is lost: not stored for its host (the wait calls this only while
    /// the host heartbeats; a lapsed one fails the turn instead).
    async fn lost(
        &self,
        ctx: &Ctx,
        host: &HostName,
        turn: &TurnId,
    ) -> Result<bool, work_queue::HoldsError> {
        let stored = work_queue::holds(
            &ctx.js,
            subjects::TRANSPORT_STREAM,
            &subjects::transport_consumer(host),
            &subjects::transport(host, "turn"),
            SCAN,
            |env| env.turn.as_ref() == Some(turn),
        )
        .await?;
        if stored {
            tracing::info!(%turn, %host, "a turn untaken this long: its command is stored, not yet taken");
        }
        Ok(!stored)
    }

    async fn send_again(&mut self, ctx: &Ctx, host: &HostName, turn: &TurnId) {
        self.again += 1;
        let copy = match copy_of(self.command) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(%turn, error = %e, "a lost turn command could not be copied");
                return;
            }
        };
        let subject = subjects::transport(host, "turn");
        match events::publish_durable(&ctx.js, subject, &copy, None).await {
            Ok(()) if self.again < MAX_AGAIN => tracing::warn!(%turn, %host, attempt = self.again,
                "a turn untaken with no command stored: its command is sent again"),
            Ok(()) => tracing::error!(%turn, %host, attempt = self.again,
                "a turn untaken with no command stored: its command is sent again, for the last time while this wait lasts"),
            Err(e) => tracing::warn!(%turn, error = %e, "send a lost turn command again"),
        }
    }
}

/// The command to send again: no word of the record (the transport reads it first), under an
/// id of its own (`<turn>:again:<random>`: not taken for a duplicate of an earlier copy).
fn copy_of(command: &Envelope) -> Result<Envelope, turnstile_shared::EnvelopeError> {
    let cmd = command.data_as::<TurnCommand>()?;
    let copy = TurnCommand {
        known: None,
        unrecorded: false,
        ..cmd
    };
    let tag = uuid::Uuid::new_v4().simple().to_string();
    Ok(copy
        .envelope()?
        .with_id(format!("{}:again:{}", copy.turn, &tag[..12])))
}
