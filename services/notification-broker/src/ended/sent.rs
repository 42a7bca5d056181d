//! What ending an execution can fail on ([`EndError`]), and its events sent with their
//! confirmations kept ([`Ack`]) to be awaited before the end is acked. A leaf: routing and the
//! ended queue both use it.

use turnstile_shared::arming;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events;

use crate::ctx::Ctx;
use crate::registry;

#[derive(Debug, thiserror::Error)]
pub(super) enum EndError {
    #[error(transparent)]
    Kv(#[from] turnstile_shared::kv::KvError),
    #[error(transparent)]
    Registry(#[from] registry::RegistryError),
    #[error(transparent)]
    Publish(#[from] events::PublishError),
    #[error(transparent)]
    Envelope(#[from] turnstile_shared::EnvelopeError),
    #[error(transparent)]
    Arm(#[from] arming::ArmError),
    #[error("read of a target session: {0}")]
    Task(#[from] tokio::task::JoinError),
}

pub(super) type Ack =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), events::PublishError>> + Send>>;

pub(super) async fn send(ctx: &Ctx, env: &Envelope) -> Result<Ack, EndError> {
    Ok(Box::pin(events::send(&ctx.js, env).await?))
}
