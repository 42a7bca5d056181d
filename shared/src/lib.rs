//! The vocabulary every Turnstile service shares: typed ids, the versioned wire envelope,
//! records kept in KV, subject names and the JetStream topology.

pub mod api;
pub mod arming;
pub mod config;
pub mod consume;
pub mod deadletter;
pub mod delivery;
pub mod duration;
pub mod envelope;
pub mod events;
pub mod execution;
pub mod ids;
pub mod kv;
pub mod lane;
pub mod names;
pub mod records;
pub mod retry;
pub mod runs;
pub mod schedules;
pub mod service;
pub mod step_api;
pub mod subjects;
pub mod telemetry;
pub mod topology;

pub use envelope::{Envelope, EnvelopeError, WIRE_VERSION};
pub use ids::{
    ConversationId, DeliveryId, EventId, ExecutionId, HostName, IdError, RunId, SessionId, StepId,
    TurnId,
};
