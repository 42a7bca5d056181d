//! Follows every turn record change durably: a turn that holds the lane becomes a node of the
//! execution tree (R2, R6), and a turn that ended takes its `turn`-scoped work with it (R7),
//! however it ended: completed, failed, its terminal died, or its session was stopped.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use tokio_util::sync::CancellationToken;
use turnstile_shared::execution::exec_reason;
use turnstile_shared::records::TurnRecord;
use turnstile_shared::{consume, topology};

use crate::ctx::Ctx;
use crate::registry::{self, Reach};

pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    consume::until_shutdown("turn mirror", &shutdown, || consume(&ctx, &shutdown)).await
}

async fn consume(
    ctx: &Arc<Ctx>,
    shutdown: &CancellationToken,
) -> Result<(), consume::ConsumeError> {
    let consumer = topology::ensure_turns_mirror_consumer(&ctx.js, &ctx.topology).await?;
    consume::each_message_showing_progress(consumer, shutdown, |msg| {
        let ctx = ctx.clone();
        async move { handle(&ctx, msg).await }
    })
    .await
}

async fn handle(ctx: &Ctx, msg: jetstream::Message) {
    // Deletes and purges carry no record; an unreadable record is not ours to judge here.
    let turn = match serde_json::from_slice::<TurnRecord>(&msg.payload) {
        Ok(t) => t,
        Err(_) => {
            let _ = msg.ack().await;
            return;
        }
    };
    match on_turn(ctx, &turn).await {
        Ok(()) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            tracing::warn!(turn = %turn.id, error = %e, "mirror turn; retrying");
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_millis(500))))
                .await;
        }
    }
}

async fn on_turn(ctx: &Ctx, turn: &TurnRecord) -> Result<(), registry::RegistryError> {
    let Some(node) = registry::mirror_turn(ctx, turn).await? else {
        return Ok(());
    };
    if turn.state.is_terminal() {
        let walked =
            registry::cancel_under(ctx, &node, Reach::TurnScoped, exec_reason::TURN_ENDED).await?;
        if !walked.cancelled.is_empty() {
            tracing::info!(turn = %turn.id, count = walked.cancelled.len(), "turn ended; its turn-scoped work is cancelled");
        }
        // This turn's end is acked only after the second look (a replica that dies before
        // then leaves it to be redelivered).
        let unrecorded = walked.unrecorded;
        registry::recheck_unrecorded(
            ctx,
            &node.id,
            unrecorded,
            Reach::TurnScoped,
            exec_reason::TURN_ENDED,
        )
        .await;
    }
    Ok(())
}
