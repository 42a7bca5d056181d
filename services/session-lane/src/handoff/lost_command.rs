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
//! gets its command sent again, under a message id of its own. One too many is harmless: the
//! command carries the record's revision (or says the lane wrote none), and a transport
//! records the turn running only over that revision (or by creating it), so a copy that finds
//! the turn taken types nothing (R1).

use std::time::Duration;

use tokio::time::Instant;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::{events, subjects, work_queue, HostName, TurnId};

use crate::ctx::Ctx;

/// Stored commands read at most when looking for one (a host's queue is short; past this it
/// counts as there).
const SCAN: usize = 1_000;

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

    /// Called on each of the wait's ticks with whether the turn is still untaken (its record
    /// missing or `queued`). Sends the command again when it is due and not stored.
    pub async fn check(&mut self, ctx: &Ctx, host: &HostName, turn: &TurnId, untaken: bool) {
        let now = Instant::now();
        if !untaken {
            self.due = now + self.after;
            return;
        }
        if now < self.due {
            return;
        }
        self.due = now + self.after;
        let subject = subjects::transport(host, "turn");
        let stored = work_queue::holds(
            &ctx.js,
            subjects::TRANSPORT_STREAM,
            &subjects::transport_consumer(host),
            &subject,
            SCAN,
            |env| env.turn.as_ref() == Some(turn),
        )
        .await;
        match stored {
            Ok(true) => {
                tracing::info!(%turn, %host, "a turn untaken this long: its command is stored, not yet taken")
            }
            Ok(false) => self.send_again(ctx, subject, turn).await,
            Err(e) => tracing::warn!(%turn, %host, error = %e, "look for a lost turn command"),
        }
    }

    async fn send_again(&mut self, ctx: &Ctx, subject: String, turn: &TurnId) {
        self.again += 1;
        let env = self
            .command
            .clone()
            .with_id(format!("{}:again:{}", self.command.id, self.again));
        match events::publish_durable(&ctx.js, subject, &env, None).await {
            Ok(()) => tracing::warn!(%turn, attempt = self.again,
                "a turn untaken with no command stored: its command is sent again"),
            Err(e) => tracing::warn!(%turn, error = %e, "send a lost turn command again"),
        }
    }
}
