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

/// An agent's step start made while the deployment cannot check its identity (the broker
/// that answers the auth callout frozen, as while a NATS node's streams elect new leaders:
/// the server refuses the connection exactly as it refuses a wrong token) keeps trying, and
/// the step starts once the check answers: the agent's step is not lost to a fail-over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_started_while_the_identity_check_is_unanswered_starts_once_it_answers() -> Result<()>
{
    let mut stack = Stack::start_deployed(&["a"], &["host-a"]).await?;
    let r = unanswered_check(&mut stack).await;
    report(&stack, r)
}

async fn unanswered_check(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("patient", None).await?;
    let caller = stack.caller(&s).await?;
    let turn = stack.send(&s, "hold\n!sleep 30s").await?;
    stack.wait_running(&turn).await?;
    let refused_before = refusals_of(stack, &s);
    let broker = stack.freeze_broker("b1")?;
    let start = tokio::process::Command::new(turnstile_tests::bin_path("turnstile")?)
        .args(["step", "start", "--name", "patient", "--", "true"])
        .env("TURNSTILE_NATS_URL", stack.nats.url())
        .env("TURNSTILE_SESSION", s.to_string())
        .env("TURNSTILE_TOKEN", &caller.token)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    // The server refused its connect (the callout went unanswered) at least once.
    let waited = turnstile_tests::wait_until(
        "the server to refuse the agent's connect",
        Duration::from_secs(20),
        || async { Ok((refusals_of(stack, &s) > refused_before).then_some(())) },
    )
    .await;
    crate::stack::signal(broker, rustix::process::Signal::CONT)?;
    waited?;
    let out = tokio::time::timeout(Duration::from_secs(40), start.wait_with_output())
        .await
        .context("step start did not finish within 40 s")??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && stdout.contains("started"),
        "step start failed after the check came back: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id: turnstile_shared::StepId = stdout
        .split_whitespace()
        .next()
        .context("the started step's id")?
        .parse()?;
    let rec = stack
        .exec(&turnstile_shared::ExecutionId::from(&id))
        .await?
        .context("the started step's record")?;
    ensure!(rec.session == s, "the step landed in {}", rec.session);
    Ok(())
}

/// How many times the server has refused a connection as session `s` (its log).
fn refusals_of(stack: &Stack, s: &turnstile_shared::SessionId) -> usize {
    let user = format!("User \"{s}\"");
    stack
        .nats
        .log_tail(100_000)
        .lines()
        .filter(|l| l.contains("authentication error") && l.contains(&user))
        .count()
}
