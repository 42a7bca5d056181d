//! Agents hold no keys: an agent's credentials (its session id and token) used directly with a
//! NATS client reach its own session's step and exec APIs and nothing else, enforced by the
//! NATS server with the identity the broker issues through the auth callout; and they stop
//! working, open connections included, within seconds of `session stop`.

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use turnstile_shared::api::{self, ErrorCode, SessionRef};
use turnstile_shared::execution::{ExecutionRecord, Scope};
use turnstile_shared::principal::Principal;
use turnstile_shared::records::SessionRecord;
use turnstile_shared::step_api::{Caller, StartStep, StepKind};
use turnstile_shared::subjects::{self, api as subj};

use crate::deployed::refused;
use crate::stack::{report, Stack, API};

/// A client on an agent's own credentials, as its tools connect, and what the server tells it
/// (errors, disconnections).
async fn connect_agent(
    stack: &Stack,
    caller: &Caller,
) -> Result<(
    async_nats::Client,
    tokio::sync::mpsc::UnboundedReceiver<String>,
)> {
    let principal = Principal::of(caller).to_string();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let client =
        async_nats::ConnectOptions::with_user_and_password(principal.clone(), caller.token.clone())
            .custom_inbox_prefix(subjects::api::inbox(&principal))
            .event_callback(move |event| {
                let tx = tx.clone();
                async move {
                    let _ = tx.send(event.to_string());
                }
            })
            .connect(stack.nats.url())
            .await
            .with_context(|| format!("connect as agent {principal}"))?;
    Ok((client, rx))
}

fn step_request(caller: &Caller, name: &str) -> StartStep {
    StartStep {
        caller: caller.clone(),
        name: name.to_string(),
        scope: Scope::Session,
        work: StepKind::External {
            queue: "agents-test".into(),
            input: serde_json::Value::Null,
        },
        id: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_credentials_reach_its_own_session_and_nothing_else() -> Result<()> {
    let mut stack = Stack::start_deployed(&["a"], &["host-a"]).await?;
    let r = own_session_only(&mut stack).await;
    report(&stack, r)
}

async fn own_session_only(stack: &mut Stack) -> Result<()> {
    let mine = stack.create_session("mine", None).await?;
    let other = stack.create_session("other", None).await?;
    let caller = stack.caller(&mine).await?;
    let (agent, mut events) = connect_agent(stack, &caller).await?;

    // Publishing anywhere but its own API subjects is refused by the server.
    for subject in [
        subjects::lane(&mine),
        "$KV.ts_sessions.forged".to_string(),
        format!("$JS.API.STREAM.DELETE.{}", subjects::LANE_STREAM),
        Principal::Session(other.clone()).steps(subj::START),
        Principal::Operator.exec(subj::CANCEL),
        subjects::transport(&"host-a".parse()?, "turn"),
    ] {
        agent.publish(subject.clone(), "{}".into()).await?;
        agent.flush().await?;
        refused(&mut events, &subject).await?;
    }
    // So is listening to commands, events and completions.
    for subject in [
        subjects::TRANSPORT_ALL,
        subjects::EVENTS_ALL,
        subjects::COMPLETION_ALL,
        "_INBOX.>",
    ] {
        let _sub = agent.subscribe(subject).await?;
        agent.flush().await?;
        refused(&mut events, subject).await?;
    }
    // Its own session's start_step works, from inside a running turn.
    let turn = stack.send(&mine, "hold\n!sleep 20s").await?;
    stack.wait_running(&turn).await?;
    let own = Principal::Session(mine.clone()).steps(subj::START);
    let rec: ExecutionRecord = api::call(&agent, &own, &step_request(&caller, "mine"), API).await?;
    ensure!(rec.session == mine, "the step landed in {}", rec.session);
    // Another session's token on its own subject is refused by the broker.
    let foreign = stack.caller(&other).await?;
    let err = api::call::<_, ExecutionRecord>(&agent, &own, &step_request(&foreign, "x"), API)
        .await
        .err()
        .context("another session's credentials were accepted")?;
    ensure!(err.code == ErrorCode::Unauthorized, "{err}");
    // A wrong token does not connect at all.
    let wrong = Caller {
        token: "not-the-token".into(),
        ..caller.clone()
    };
    match connect_agent(stack, &wrong).await {
        Ok(_) => bail!("a wrong token connected"),
        Err(e) => ensure!(
            format!("{e:#}").to_lowercase().contains("authorization"),
            "{e:#}"
        ),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_sessions_credentials_are_refused_within_seconds() -> Result<()> {
    let mut stack = Stack::start_deployed(&["a"], &["host-a"]).await?;
    let r = stopped_session(&mut stack).await;
    report(&stack, r)
}

async fn stopped_session(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("stopping", None).await?;
    let caller = stack.caller(&s).await?;
    let (agent, mut events) = connect_agent(stack, &caller).await?;
    // The open connection works before the stop (an error reply from the broker is an answer).
    let list = Principal::Session(s.clone()).steps(subj::LIST);
    let listed: turnstile_shared::page::Page<ExecutionRecord> = api::call(
        &agent,
        &list,
        &turnstile_shared::step_api::ListSteps {
            caller: caller.clone(),
            page: Default::default(),
        },
        API,
    )
    .await?;
    ensure!(listed.items.is_empty(), "{listed:?}");
    while events.try_recv().is_ok() {}

    let stopped_at = tokio::time::Instant::now();
    let _: SessionRecord = api::call(
        &stack.client,
        subj::SESSION_STOP,
        &SessionRef { session: s.clone() },
        API,
    )
    .await?;
    // The open connection is ended by the server...
    let deadline = stopped_at + Duration::from_secs(5);
    loop {
        let e = tokio::time::timeout_at(deadline, events.recv())
            .await
            .map_err(|_| anyhow::anyhow!("the open connection was not ended within 5 s"))?
            .context("event channel closed")?;
        if e.contains("disconnected") {
            break;
        }
    }
    // ...and a new one is refused.
    match connect_agent(stack, &caller).await {
        Ok(_) => bail!("a stopped session's credentials connected"),
        Err(e) => ensure!(
            format!("{e:#}").to_lowercase().contains("authorization"),
            "{e:#}"
        ),
    }
    ensure!(
        stopped_at.elapsed() < Duration::from_secs(5),
        "refused only after {:?}",
        stopped_at.elapsed()
    );
    // Another session's agent is untouched.
    let other = stack.create_session("staying", None).await?;
    let other_caller = stack.caller(&other).await?;
    let (still, _) = connect_agent(stack, &other_caller).await?;
    let _: turnstile_shared::page::Page<ExecutionRecord> = api::call(
        &still,
        &Principal::Session(other.clone()).steps(subj::LIST),
        &turnstile_shared::step_api::ListSteps {
            caller: other_caller,
            page: Default::default(),
        },
        API,
    )
    .await?;
    Ok(())
}
