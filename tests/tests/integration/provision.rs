//! Provisioning is an explicit deployment step (`turnstile admin provision`); services only
//! bind the topology. A service started first waits, saying what is missing, and serves as soon
//! as the topology exists; provisioning twice changes nothing.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::api::{self, ErrorCode, ListSessions};
use turnstile_shared::records::TurnState;
use turnstile_shared::subjects::api as subj;
use turnstile_tests::wait_until;

use crate::stack::{report, signal, Stack, API};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_started_before_provisioning_wait_for_it_then_serve() -> Result<()> {
    let mut stack = Stack::bare(&[]).await?;
    let r = provision_late(&mut stack).await;
    report(&stack, r)
}

async fn provision_late(stack: &mut Stack) -> Result<()> {
    stack.spawn_lane("a")?;
    stack.spawn_transport("h1")?;
    stack.spawn_broker("b1")?;
    stack.spawn_scheduler("s1")?;
    // Each service names the missing stream and the command that makes it.
    for (what, p) in stack
        .lanes
        .iter()
        .chain(&stack.transports)
        .chain(&stack.brokers)
        .chain(&stack.schedulers)
    {
        wait_until(
            &format!("{what} to report the missing topology"),
            Duration::from_secs(20),
            || async move {
                let log = p.log_tail(200);
                Ok((log.contains("topology not ready")
                    && log.contains("turnstile admin provision"))
                .then_some(()))
            },
        )
        .await?;
    }
    let before: Result<serde_json::Value, api::ApiError> = api::call(
        &stack.client,
        subj::SESSION_LIST,
        &ListSessions::default(),
        API,
    )
    .await;
    ensure!(
        matches!(&before, Err(e) if e.code == ErrorCode::Unavailable),
        "no session API before provisioning: {before:?}"
    );
    // Nothing lingers (R13): a service waiting for the topology stops on SIGTERM.
    let waiting = stack.schedulers.get_mut("s1").context("s1")?;
    let pid = waiting.pid().context("scheduler pid")?;
    signal(pid, rustix::process::Signal::TERM)?;
    waiting.wait_exit(Duration::from_secs(10)).await?;
    stack.spawn_scheduler("s2")?;
    stack.provision().await?;
    stack.provision().await?;
    stack.wait_serving(true).await?;
    let s = stack.create_session("late", None).await?;
    let turn = stack.send(&s, "!reply provisioned").await?;
    let rec = stack.wait_turn(&turn, Duration::from_secs(30)).await?;
    ensure!(
        matches!(rec.state, TurnState::Completed { .. }),
        "turn after late provisioning: {:?}",
        rec.state
    );
    Ok(())
}

/// A deployment of an older build keeps its lanes on a work-queue stream. Provisioning with
/// this build moves what it holds (queued, and in flight when the services stopped) onto the
/// limits-retention lane stream and deletes it; the lanes then serve each item once, and
/// remove it once done. An item the old lane had acked is not brought back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisioning_moves_a_legacy_work_queue_lane_and_its_items() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = legacy_lanes(&mut stack).await;
    report(&stack, r)
}

async fn legacy_lanes(stack: &mut Stack) -> Result<()> {
    use async_nats::jetstream::{consumer, stream};
    use futures::StreamExt;
    use turnstile_shared::lane::{LaneItem, TurnItem};
    use turnstile_shared::{subjects, TurnId};

    let s = stack.create_session("legacy", None).await?;
    // The services stop for the upgrade; the old build's lane stream is what is left.
    let lane = stack.lanes.get_mut("a").context("lane a")?;
    signal(
        lane.pid().context("lane pid")?,
        rustix::process::Signal::TERM,
    )?;
    lane.wait_exit(Duration::from_secs(20)).await?;
    let admin = stack.js_as("admin").await?;
    admin.delete_stream(subjects::LANE_STREAM).await?;
    let legacy = admin
        .create_stream(stream::Config {
            name: subjects::LEGACY_LANE_STREAM.to_string(),
            subjects: vec![subjects::LANE_ALL.to_string()],
            retention: stream::RetentionPolicy::WorkQueue,
            allow_direct: true,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await?;
    let old_lane = legacy
        .create_consumer(consumer::pull::Config {
            durable_name: Some(subjects::lane_consumer(&s)),
            filter_subject: subjects::lane(&s),
            ack_policy: consumer::AckPolicy::Explicit,
            max_ack_pending: 1,
            ..Default::default()
        })
        .await?;
    let items: Vec<(TurnId, &str)> = ["!reply acked long ago", "!reply in flight", "!reply queued"]
        .into_iter()
        .map(|text| (TurnId::new(), text))
        .collect();
    let mut seqs = Vec::new();
    for (turn, text) in &items {
        let item = LaneItem::Turn(TurnItem {
            turn: turn.clone(),
            text: text.to_string(),
            recorded: None,
        });
        seqs.push(
            turnstile_shared::events::publish_durable_at(
                &admin,
                subjects::lane(&s),
                &item.to_envelope(&s)?,
            )
            .await?,
        );
    }
    // The old lane served the first item to its end (an acked item of a work queue is gone)
    // and held the second when it stopped.
    legacy.delete_message(seqs[0]).await?;
    let mut taken = old_lane.fetch().max_messages(1).messages().await?;
    let second = taken
        .next()
        .await
        .context("second item")?
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(
        second.payload.windows(9).any(|w| w == b"in flight"),
        "the old lane held another item"
    );

    stack.provision().await?;
    ensure!(
        admin
            .get_stream(subjects::LEGACY_LANE_STREAM)
            .await
            .is_err(),
        "the legacy lane stream is still there"
    );
    let info = stack.js.get_stream(subjects::LANE_STREAM).await?;
    ensure!(
        info.cached_info().config.retention == stream::RetentionPolicy::Limits,
        "lane stream retention: {:?}",
        info.cached_info().config.retention
    );
    ensure!(
        stack.lane_items(&s).await?.len() == 2,
        "the in-flight and the queued item are moved, the acked one is not"
    );
    // Provisioning again finds nothing left to move.
    stack.provision().await?;
    ensure!(stack.lane_items(&s).await?.len() == 2, "moved twice");

    stack.spawn_lane("b")?;
    let moved: Vec<TurnId> = items[1..].iter().map(|(t, _)| t.clone()).collect();
    stack.all_complete(&moved).await?;
    ensure!(
        stack.turn(&items[0].0).await?.is_none(),
        "the item the old lane had acked was served again"
    );
    let transcript = stack.transcript(&s).await?;
    for text in ["!reply in flight", "!reply queued"] {
        ensure!(
            crate::stack::count(&transcript, text) == 1,
            "{text:?} typed other than once: {transcript:?}"
        );
    }
    stack.wait_lane_emptied(&s).await?;
    Ok(())
}

/// An older build kept the replicas bucket in memory, and a server restart dropped it.
/// Provisioning makes such a bucket again on file storage, once: the running replica finds
/// its liveness key gone and stops, fenced (handing nothing back), and a replica started
/// afterwards binds and serves. Provisioning again leaves the file-stored bucket and its keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisioning_moves_a_memory_replicas_bucket_to_file_storage() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = memory_replicas(&mut stack).await;
    report(&stack, r)
}

async fn memory_replicas(stack: &mut Stack) -> Result<()> {
    use async_nats::jetstream::{kv, stream::StorageType};
    use turnstile_shared::subjects;

    let s = stack.create_session("replicas-on-file", None).await?;
    let admin = stack.js_as("admin").await?;
    let storage = |js: async_nats::jetstream::Context| async move {
        let mut stream = js.get_stream(subjects::REPLICAS_KV_STREAM).await?;
        anyhow::Ok(stream.info().await?.config.storage)
    };
    ensure!(
        storage(admin.clone()).await? == StorageType::File,
        "a fresh deployment keeps replica liveness on file"
    );
    // What an older build provisioned.
    admin.delete_stream(subjects::REPLICAS_KV_STREAM).await?;
    admin
        .create_key_value(kv::Config {
            bucket: subjects::REPLICAS_BUCKET.to_string(),
            history: 1,
            storage: StorageType::Memory,
            ..Default::default()
        })
        .await?;
    stack.provision().await?;
    ensure!(
        storage(admin.clone()).await? == StorageType::File,
        "provisioning leaves the replicas bucket in memory"
    );
    let lane = stack.lanes.get_mut("a").context("lane a")?;
    let status = lane.wait_exit(Duration::from_secs(20)).await?;
    ensure!(
        !status.success(),
        "a replica whose liveness key vanished must stop, fenced: {status}"
    );
    ensure!(
        lane.log_tail(200).contains("taken for dead"),
        "the fenced replica says why it stopped"
    );
    stack.spawn_lane("a2")?;
    stack.wait_serving(true).await?;
    let turn = stack.send(&s, "!reply on file").await?;
    let rec = stack.wait_turn(&turn, Duration::from_secs(30)).await?;
    ensure!(
        matches!(rec.state, TurnState::Completed { .. }),
        "turn after the replicas bucket moved: {:?}",
        rec.state
    );
    // Provisioning again changes nothing: the new replica's key is still there.
    let replicas = admin.get_key_value(subjects::REPLICAS_BUCKET).await?;
    let keys_before = live_keys(&replicas).await?;
    ensure!(!keys_before.is_empty(), "replica a2 announced itself");
    stack.provision().await?;
    ensure!(
        live_keys(&replicas).await? == keys_before,
        "provisioning again dropped liveness keys"
    );
    Ok(())
}

async fn live_keys(kv: &async_nats::jetstream::kv::Store) -> Result<Vec<String>> {
    use futures::TryStreamExt;
    let mut keys: Vec<String> = kv
        .keys()
        .await?
        .try_collect::<Vec<_>>()
        .await?
        .into_iter()
        .filter(|k| k.starts_with("live."))
        .collect();
    keys.sort();
    Ok(keys)
}
