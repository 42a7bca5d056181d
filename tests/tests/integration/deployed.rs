//! The shipped `deploy/nats-server.conf` runs a whole deployment: provisioning with the admin
//! user, and every service, the agents and the test's own CLI client on their own users with
//! the permissions the file gives them. A service that starts using a subject its user may not
//! use fails here, so the file cannot go stale unnoticed; and the file is the output of
//! `turnstile admin nats-config`, the generator every other test's server config comes from.

use std::time::Duration;

use anyhow::{ensure, Result};
use turnstile_shared::runs::RunState;
use turnstile_shared::schedules::SlotOutcome;

use futures::StreamExt;
use turnstile_shared::config::{connect_once, is_permission_error, permission_refusals};
use turnstile_shared::subjects;

use crate::stack::{report, schedule, Stack};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_server_config_serves_every_service_on_its_own_user() -> Result<()> {
    let mut stack = Stack::start_deployed(&["a"], &["host-a"]).await?;
    let r = whole_deployment(&mut stack).await;
    report(&stack, r)
}

async fn whole_deployment(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("deployed", None).await?;
    // A turn whose agent starts a step (with the credentials its terminal got), and the
    // step's result handed back in a delivery turn.
    stack.turn_with_a_step_handed_back(&s).await?;
    // A run (session-lane, with the broker's tree) and a schedule (the scheduler fires runs).
    let run = stack.start_run(&s, &["!reply in a run"], None).await?;
    let done = stack.wait_run(&run.id, Duration::from_secs(30)).await?;
    ensure!(
        matches!(done.state, RunState::Completed { .. }),
        "run: {:?}",
        done.state
    );
    stack
        .add_schedule(&schedule(
            "deployed-2s",
            "*/2 * * * * *",
            &s,
            &["!reply tick"],
        ))
        .await?;
    let slots = stack
        .wait_slots("deployed-2s", 1, Duration::from_secs(30))
        .await?;
    let SlotOutcome::Fired { run, .. } = &slots[0].outcome else {
        anyhow::bail!("first slot: {:?}", slots[0].outcome);
    };
    let fired = stack.wait_run(run, Duration::from_secs(30)).await?;
    ensure!(
        matches!(fired.state, RunState::Completed { .. }),
        "scheduled run: {:?}",
        fired.state
    );
    // Nothing was refused on the way: a refusal a service survives is still a stale file.
    let log = stack.nats.log_tail(100_000);
    let refused: Vec<&str> = log.lines().filter(|l| l.contains("Violation")).collect();
    ensure!(
        refused.is_empty(),
        "the server refused:\n{}",
        refused.join("\n")
    );
    Ok(())
}

/// The observer follows events and may publish nothing; a service may not delete a stream.
/// Each refusal is the server's permission error, seen by the client that tried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployed_users_are_refused_what_they_may_not_do() -> Result<()> {
    let mut stack = Stack::start_deployed(&["a"], &["host-a"]).await?;
    let r = refusals(&mut stack).await;
    report(&stack, r)
}

/// Waits (≤ 10 s) for the server's permission error naming `subject`, as the client sees it.
pub async fn refused(
    errors: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    subject: &str,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let e = tokio::time::timeout_at(deadline, errors.recv())
            .await
            .map_err(|_| anyhow::anyhow!("no permission error for {subject} within 10 s"))?
            .ok_or_else(|| anyhow::anyhow!("connection closed"))?;
        if is_permission_error(&e) && e.contains(subject) {
            return Ok(());
        }
    }
}

async fn refusals(stack: &mut Stack) -> Result<()> {
    let (observer, mut observer_errors) = stack.connect_as("observer").await?;
    let mut events = observer.subscribe(subjects::EVENTS_ALL).await?;
    observer.flush().await?;
    stack.create_session("watched", None).await?;
    tokio::time::timeout(Duration::from_secs(10), events.next())
        .await
        .map_err(|_| anyhow::anyhow!("the observer saw no event"))?;
    observer.publish("ts.lane.forged", "x".into()).await?;
    observer.flush().await?;
    refused(&mut observer_errors, "ts.lane.forged").await?;
    // It may read through the read-only APIs (what `turnstile dashboard` shows), with replies
    // to its own inbox only, and change nothing through the others.
    let reader = async_nats::ConnectOptions::with_user_and_password(
        "observer".into(),
        stack.password("observer")?,
    )
    .custom_inbox_prefix(subjects::api::inbox(
        turnstile_shared::permissions::OBSERVER_INBOX,
    ))
    .connect(stack.nats.url())
    .await?;
    let listed: turnstile_shared::page::Page<turnstile_shared::api::SessionView> =
        turnstile_shared::api::call(
            &reader,
            subjects::api::SESSION_LIST,
            &turnstile_shared::api::ListSessions::default(),
            crate::stack::API,
        )
        .await?;
    ensure!(
        listed.items.iter().any(|v| v.session.name == "watched"),
        "the observer's session list: {listed:?}"
    );
    let cancel = subjects::api::exec(subjects::api::OPERATOR, subjects::api::CANCEL);
    for subject in [
        subjects::api::SESSION_CREATE,
        subjects::api::RUNS_START,
        cancel.as_str(),
    ] {
        observer.publish(subject.to_string(), "{}".into()).await?;
        observer.flush().await?;
        refused(&mut observer_errors, subject).await?;
    }
    // Every other client's replies are not the observer's to read.
    let _others = observer.subscribe("_INBOX.>").await?;
    observer.flush().await?;
    refused(&mut observer_errors, "_INBOX.>").await?;
    // Through the connection every service makes, a refusal is logged as an error and counted.
    let before = permission_refusals();
    let service_way = connect_once(
        &stack.nats.url_as("observer", &stack.password("observer")?),
        "test-probe",
    )
    .await?;
    service_way.publish("ts.lane.forged", "x".into()).await?;
    service_way.flush().await?;
    turnstile_tests::wait_until(
        "the refusal to be counted",
        Duration::from_secs(10),
        || async { Ok((permission_refusals() > before).then_some(())) },
    )
    .await?;

    let (broker, mut broker_errors) = stack.connect_as("notification-broker").await?;
    let js = async_nats::jetstream::new(broker);
    let attempt = tokio::time::timeout(
        Duration::from_secs(5),
        js.delete_stream(subjects::LANE_STREAM),
    )
    .await;
    ensure!(!matches!(attempt, Ok(Ok(_))), "the broker deleted a stream");
    refused(&mut broker_errors, "$JS.API.STREAM.DELETE.TS_LANE").await?;
    stack.js.get_stream(subjects::LANE_STREAM).await?;

    // A transport agent cannot read another host's commands: not by pulling from that host's
    // consumer, not with a consumer of its own on the stream, not by reading the stream's
    // messages, not on the core subjects.
    let (transport, mut transport_errors) = stack.connect_as("transport-host-a").await?;
    let other: turnstile_shared::ids::HostName = "host-b".parse()?;
    let stream = subjects::TRANSPORT_STREAM;
    let pull = format!(
        "$JS.API.CONSUMER.MSG.NEXT.{stream}.{}",
        subjects::transport_consumer(&other)
    );
    let own_consumer = format!("$JS.API.CONSUMER.CREATE.{stream}.spy.ts.transport.host-b.>");
    let read = format!("$JS.API.DIRECT.GET.{stream}");
    for subject in [pull, own_consumer, read] {
        transport.publish(subject.clone(), "{}".into()).await?;
        transport.flush().await?;
        refused(&mut transport_errors, &subject).await?;
    }
    let core = subjects::transport_host_all(&other);
    let _sub = transport.subscribe(core.clone()).await?;
    transport.flush().await?;
    refused(&mut transport_errors, &core).await?;
    Ok(())
}

/// The shipped config is the generator's output for its hosts, so it cannot drift from the
/// permission table (and the table is what every other test runs on).
#[test]
fn the_shipped_server_config_is_the_generators_output() -> Result<()> {
    let mut single: Vec<String> = vec!["admin".into(), "nats-config".into()];
    for h in crate::stack::SHIPPED_HOSTS {
        single.extend(["--host".to_string(), h.to_string()]);
    }
    // The compose file's cluster profile: three nodes named after their services.
    let mut cluster = single.clone();
    cluster.extend(["--cluster-name".to_string(), "turnstile".to_string()]);
    for node in ["nats", "nats-2", "nats-3"] {
        cluster.extend(["--route".to_string(), format!("nats://{node}:6222")]);
    }
    for (args, file) in [(single, "nats-server.conf"), (cluster, "nats-cluster.conf")] {
        let out = std::process::Command::new(turnstile_tests::bin_path("turnstile")?)
            .args(&args)
            .output()?;
        ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let shipped = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../deploy")
                .join(file),
        )?;
        ensure!(
            shipped == String::from_utf8(out.stdout)?,
            "deploy/{file} is not `turnstile {}`: run it again",
            args.join(" ")
        );
    }
    Ok(())
}
