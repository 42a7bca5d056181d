//! The vocabulary every Turnstile service shares: typed ids, the versioned wire envelope,
//! records kept in KV, subject names and the JetStream topology.
//!
//! Layout, from the bottom up (a module uses only those above it in this list):
//!
//! - `ids`, `names`, `duration`, `retry`, `private_file`: typed ids with prefixes; enum names
//!   spelled once; the one duration grammar; the one retry policy; files that hold secrets;
//!   `js_codes`: the JetStream error codes branched on.
//! - `subjects`: every stream, bucket, consumer and subject name (nothing else spells them);
//!   `permissions`: who may use which of them; `server_config` writes the server's config
//!   from it.
//! - `envelope`: the versioned wire envelope (an unknown version is refused, R15).
//! - `events`: the event-kind registry (`EventKind`) and the one publish path.
//! - `api`: request/reply types, the error-code registry (`ErrorCode`) and the typed client;
//!   `service`: the request loop behind every endpoint.
//! - `kv`: typed compare-and-set over KV buckets; `topology`: provisioning (`lane_migration`: moving the
//!   lanes off the work-queue stream of older builds); `config`: flags
//!   and connect; `consume`: the durable-consumer loops; `deadletter`: refusals; `telemetry`;
//!   `health`: the `/healthz` and `/readyz` endpoints; `bucket_watch`: the loop behind a
//!   watch of a bucket's new writes; `backstop`: the loop behind the backstops for records
//!   left waiting on a lost message; `work_queue`: what a work queue still holds for its
//!   consumer (where those backstops look before publishing again).
//! - Records: `records` (sessions, turns, hosts, transport commands), `execution` (the tree),
//!   `delivery` (completions and the delivery item), `runs`, `schedules`, `step_api`.
//! - `lane`: the lane item, above the records it carries, and its removal once done;
//!   `arming`: arming a session's one delivery item, above the lane item.
//! - `principal`: who an agent-facing call acts for (the token its subjects carry), above
//!   `step_api`; `service` serves endpoints scoped by it.

pub mod api;
pub mod arming;
pub mod backstop;
pub mod bucket_watch;
pub mod config;
pub mod consume;
pub mod deadletter;
pub mod delivery;
pub mod duration;
pub mod envelope;
pub mod events;
pub mod execution;
#[cfg(test)]
mod fuzz;
pub mod health;
pub mod ids;
pub mod js_codes;
pub mod kv;
pub mod lane;
pub mod lane_migration;
pub mod metrics;
pub mod names;
pub mod page;
pub mod permissions;
pub mod policy;
pub mod principal;
pub mod private_file;
pub mod records;
pub mod removal;
pub mod retention;
pub mod retry;
pub mod runs;
pub mod schedules;
pub mod server_config;
pub mod service;
pub mod service_info;
pub mod step_api;
pub mod subjects;
pub mod telemetry;
pub mod topology;
pub mod work_queue;

pub use envelope::{Envelope, EnvelopeError, WIRE_VERSION};
pub use ids::{
    ConversationId, DeliveryId, EventId, ExecutionId, HostName, IdError, RunId, SessionId, StepId,
    TurnId,
};
