//! What the API and the ticker share: the NATS handles and the buckets, and the service's
//! `Error`. Apart from `lib.rs`, which starts both tasks, so that they need not import the
//! file that calls them.

use turnstile_shared::config::StartError;
use turnstile_shared::topology::Buckets;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("start API service: {0}")]
    Api(async_nats::Error),
}

pub(crate) struct Ctx {
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub buckets: Buckets,
}
