//! How answering the auth callout fails. Apart from `mod.rs`, which answers on `Ctx`, because
//! the service's `Error` (beside `Ctx`) holds it and `revoke.rs` returns it.

#[derive(Debug, thiserror::Error)]
pub enum CalloutError {
    #[error("the auth callout issuer seed: {0}")]
    Seed(String),
    #[error("subscribe to {subject}: {source}")]
    Subscribe {
        subject: &'static str,
        source: async_nats::SubscribeError,
    },
    #[error(transparent)]
    Connect(#[from] turnstile_shared::config::StartError),
}
