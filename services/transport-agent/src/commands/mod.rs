//! Consumes this host's transport commands (`start`, `turn`, `stop`). A turn is recorded as
//! `running` (an acknowledged KV write) before a single key is typed, and its command is acked
//! only once the outcome is recorded, so a redelivered command never types twice (R14).
//!
//! `session.rs` readies and stops a session's agent (its spec, cached; one launch at a time),
//! `turn.rs` drives a turn to its outcome, `record.rs` writes that outcome.

use std::sync::Arc;

use async_nats::jetstream::{self};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::{host_event, EventKind};
use turnstile_shared::records::{transport_kind, StartCommand, StopCommand, TurnCommand};
use turnstile_shared::{consume, deadletter, subjects, topology};

use crate::ctx::{Ctx, Error};

mod record;
mod session;
mod turn;

use session::{handle_start, handle_stop};
use turn::handle_turn;

pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) -> Result<(), Error> {
    consume::until_shutdown("transport commands", &shutdown, || consume(&ctx, &shutdown)).await;
    Ok(())
}

async fn consume(
    ctx: &Arc<Ctx>,
    shutdown: &CancellationToken,
) -> Result<(), consume::ConsumeError> {
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
        Ok(event) => {
            deadletter::refuse(&ctx.js, msg, dlq, reason, &event).await;
        }
        Err(e) => tracing::error!(%host, error = %e, "build transport.rejected"),
    }
}
