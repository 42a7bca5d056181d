//! Why collecting or settling completions failed; the item kinds retry their item on it.

use turnstile_shared::{topology, SessionId};

#[derive(Debug, thiserror::Error)]
pub(crate) enum DeliveryError {
    #[error(transparent)]
    Kv(#[from] turnstile_shared::kv::KvError),
    #[error(transparent)]
    Topology(#[from] topology::TopologyError),
    #[error("fetch completions of {session}: {source}")]
    Fetch {
        session: SessionId,
        source: async_nats::Error,
    },
    #[error(transparent)]
    Nats(#[from] async_nats::Error),
    #[error("turn {0} was recorded meanwhile; going on with it")]
    Recorded(turnstile_shared::TurnId),
}
