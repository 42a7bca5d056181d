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
