//! The durable consumers each service ensures (idempotent: created, or left as they are):
//! lanes, transport commands, completions, step work, the broker's queues and mirrors.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};

use crate::ids::{HostName, SessionId};
use crate::subjects;

use super::{TopologyConfig, TopologyError};

/// A session's exclusive lane consumer: one item in flight, pinned to one replica (R1).
pub async fn ensure_lane_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    session: &SessionId,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::lane_consumer(session);
    let config = consumer::pull::Config {
        durable_name: Some(name.clone()),
        filter_subject: subjects::lane(session),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: cfg.lane_ack_wait,
        max_ack_pending: 1,
        max_deliver: -1,
        priority_policy: consumer::PriorityPolicy::PinnedClient,
        priority_groups: vec![subjects::LANE_GROUP.to_string()],
        priority_timeout: cfg.lane_pin_ttl,
        ..Default::default()
    };
    create_consumer(js, subjects::LANE_STREAM, &name, config).await
}

/// The one consumer of a host's transport commands.
pub async fn ensure_transport_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    host: &HostName,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::transport_consumer(host);
    let config = durable(
        &name,
        subjects::transport_host_all(host),
        cfg.transport_ack_wait,
        100_000,
    );
    create_consumer(js, subjects::TRANSPORT_STREAM, &name, config).await
}

/// A session's pending completions (R3): pulled in batches by its delivery turns, held
/// unacked (with progress acks) until the turn that handed them over completed.
pub async fn ensure_completion_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    session: &SessionId,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::completion_consumer(session);
    let config = durable(
        &name,
        subjects::completion_session_all(session),
        cfg.lane_ack_wait,
        10_000,
    );
    create_consumer(js, subjects::COMPLETION_STREAM, &name, config).await
}

/// A host's `command` step work, taken by its transport agent.
pub async fn ensure_step_command_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    host: &HostName,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::step_command_consumer(host);
    step_work_consumer(js, cfg, name, subjects::step_command(host)).await
}

/// The shared consumer of the workers serving one `external` step queue.
pub async fn ensure_step_external_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    queue: &str,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::step_external_consumer(queue);
    step_work_consumer(js, cfg, name, subjects::step_external(queue)).await
}

async fn step_work_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    name: String,
    filter: String,
) -> Result<consumer::PullConsumer, TopologyError> {
    let config = durable(&name, filter, cfg.transport_ack_wait, 100_000);
    create_consumer(js, subjects::STEP_STREAM, &name, config).await
}

/// The broker's queue of execution ends to record and route (shared by its replicas).
pub async fn ensure_ended_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::BROKER_ENDED_CONSUMER.to_string();
    let config = durable(
        &name,
        subjects::STEP_ENDED_ALL.to_string(),
        cfg.service_ack_wait,
        1_000,
    );
    create_consumer(js, subjects::STEP_STREAM, &name, config).await
}

/// The broker's queue of background agents to launch.
pub async fn ensure_agents_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::BROKER_AGENTS_CONSUMER.to_string();
    let config = durable(
        &name,
        subjects::STEP_AGENT.to_string(),
        cfg.service_ack_wait,
        100_000,
    );
    create_consumer(js, subjects::STEP_STREAM, &name, config).await
}

/// The broker's view of run ends (to finish background-agent steps), from the event stream.
pub async fn ensure_run_ends_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::BROKER_RUN_ENDS_CONSUMER.to_string();
    let config = consumer::pull::Config {
        filter_subject: String::new(),
        filter_subjects: subjects::RUN_ENDS.iter().map(|s| s.to_string()).collect(),
        ..durable(&name, String::new(), cfg.service_ack_wait, 1_000)
    };
    create_consumer(js, subjects::EVENTS_STREAM, &name, config).await
}

/// The broker's durable view of every turn record change (mirror and R7 on turn end).
pub async fn ensure_turns_mirror_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
) -> Result<consumer::PullConsumer, TopologyError> {
    mirror_consumer(
        js,
        cfg,
        subjects::BROKER_TURNS_CONSUMER,
        subjects::TURNS_KV_STREAM,
        subjects::TURNS_KV_ALL,
    )
    .await
}

/// The broker's durable view of every run record change (runs and messages in the tree).
pub async fn ensure_runs_mirror_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
) -> Result<consumer::PullConsumer, TopologyError> {
    mirror_consumer(
        js,
        cfg,
        subjects::BROKER_RUNS_CONSUMER,
        subjects::RUNS_KV_STREAM,
        subjects::RUNS_KV_ALL,
    )
    .await
}

async fn mirror_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    name: &str,
    stream: &str,
    filter: &str,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = name.to_string();
    let config = durable(&name, filter.to_string(), cfg.service_ack_wait, 1_000);
    create_consumer(js, stream, &name, config).await
}

/// A durable pull consumer with explicit acks and unlimited redelivery: every consumer of
/// ours but the lanes' (which add the pinned-client priority group).
fn durable(
    name: &str,
    filter: String,
    ack_wait: Duration,
    max_ack_pending: i64,
) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: Some(name.to_string()),
        filter_subject: filter,
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait,
        max_ack_pending,
        max_deliver: -1,
        ..Default::default()
    }
}

async fn create_consumer(
    js: &jetstream::Context,
    stream_name: &str,
    name: &str,
    config: consumer::pull::Config,
) -> Result<consumer::PullConsumer, TopologyError> {
    let err = |e: async_nats::Error| TopologyError::Consumer {
        stream: stream_name.to_string(),
        name: name.to_string(),
        source: e,
    };
    let stream = js
        .get_stream_no_info(stream_name)
        .await
        .map_err(|e| err(e.into()))?;
    stream
        .create_consumer(config)
        .await
        .map_err(|e| err(e.into()))
}
