//! The lifecycle events of a busy stack against `docs/asyncapi.yaml`: a stack driven through
//! most event kinds on purpose, every stored event checked by `asyncapi::check_events`.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::subjects;

use crate::stack::{report, Stack};

/// A stack driven through most event kinds on purpose: sessions, turns (one failing), a run
/// whose steps complete, fail and are cancelled, a run that fails and is retried, a schedule
/// added, fired, paused, resumed, triggered and deleted, refused input of each service, and a
/// stop with a turn on the lane. Every stored event must match the document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_of_a_busy_stack_is_described_by_the_asyncapi_document() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = busy(&mut stack).await;
    report(&stack, r)
}

async fn busy(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::api;
    use turnstile_shared::runs::{RunLimits, RunState};
    use turnstile_shared::schedules::{PauseSchedule, ScheduleRef};
    use turnstile_shared::subjects::api as subj;
    use turnstile_shared::StepId;

    let s = stack.create_session("described", None).await?;
    // A turn whose step is handed back in a delivery turn.
    stack.turn_with_a_step_handed_back(&s).await?;
    // A run: one step completes, one fails, one (turn-scoped) is cancelled when its turn ends.
    let run = stack
        .start_run(
            &s,
            &["work\n!step ok 300ms --scope run\n!step bad 300ms fail --scope run\n!step cut 30s --scope turn\n!sleep 1s"],
            None,
        )
        .await?;
    stack.wait_run(&run.id, Duration::from_secs(60)).await?;
    // A run that fails (one round allowed, its step needs a second) and is retried.
    let limits = RunLimits {
        max_rounds: 1,
        ..RunLimits::default()
    };
    let failing = stack
        .start_run_with(
            &s,
            &["!step late 300ms --scope run\n!sleep 100ms"],
            None,
            limits,
        )
        .await?;
    let ended = stack.wait_run(&failing.id, Duration::from_secs(60)).await?;
    ensure!(
        matches!(ended.state, RunState::Failed { .. }),
        "{:?}",
        ended.state
    );
    stack.retry_run(&failing.id).await?;
    stack.wait_run(&failing.id, Duration::from_secs(60)).await?;
    // A schedule: fired, then paused, resumed, triggered and deleted.
    let name = "described-tick";
    stack
        .add_schedule(&crate::stack::schedule(name, "* * * * * *", &s, &["tick"]))
        .await?;
    stack.wait_slots(name, 1, Duration::from_secs(30)).await?;
    let _: serde_json::Value = api::call(
        &stack.client,
        subj::SCHEDULES_PAUSE,
        &PauseSchedule {
            name: name.into(),
            note: "described".into(),
        },
        crate::stack::API,
    )
    .await?;
    for subject in [
        subj::SCHEDULES_RESUME,
        subj::SCHEDULES_TRIGGER,
        subj::SCHEDULES_DELETE,
    ] {
        let _: serde_json::Value = api::call(
            &stack.client,
            subject,
            &ScheduleRef { name: name.into() },
            crate::stack::API,
        )
        .await?;
    }
    // Refused input: a lane item, a transport command, a step end, a report's credentials.
    stack
        .js
        .publish(subjects::lane(&s), "{not json".into())
        .await?
        .await?;
    let host = "h1".parse()?;
    stack
        .js_as("session-lane")
        .await?
        .publish(subjects::transport(&host, "turn"), "garbage".into())
        .await?
        .await?;
    stack
        .js_as("notification-broker")
        .await?
        .publish(
            subjects::step_ended(&StepId::new().into()),
            "{garbage".into(),
        )
        .await?
        .await?;
    let refused = stack.report_with_a_wrong_token().await;
    ensure!(refused.is_err(), "a report without a step was accepted");
    // A stop with a turn running and one queued (turn.failed, session.stopped).
    let busy = stack.send(&s, "!sleep 20s").await?;
    stack.wait_running(&busy).await?;
    stack.send(&s, "never typed").await?;
    // A run cancelled while it waits on the lane ends at once, and says so.
    let waiting = stack.start_run(&s, &["never run"], None).await?;
    stack.cancel_run(&waiting.id).await?;
    let ended = stack
        .events()
        .await?
        .into_iter()
        .find(|e| e.kind == "run.failed" && e.data["run"] == waiting.id.as_str())
        .context("no run.failed for the run cancelled while queued")?;
    ensure!(
        ended.data["state"]["reason"] == "cancelled",
        "cancelled while queued: {}",
        ended.data
    );
    let _: serde_json::Value = api::call(
        &stack.client,
        subj::SESSION_STOP,
        &turnstile_shared::api::SessionRef { session: s.clone() },
        crate::stack::API,
    )
    .await?;

    let want = [
        "session.created",
        "turn.queued",
        "turn.started",
        "turn.completed",
        "turn.failed",
        "terminal.ready",
        "host.up",
        "step.queued",
        "step.running",
        "step.completed",
        "step.failed",
        "step.cancelled",
        "completion.routed",
        "delivery.queued",
        "delivery.completed",
        "run.queued",
        "run.started",
        "run.round",
        "run.completed",
        "run.failed",
        "run.retried",
        "schedule.added",
        "schedule.paused",
        "schedule.resumed",
        "schedule.triggered",
        "schedule.deleted",
        "slot.fired",
        "lane.rejected",
        "transport.rejected",
        "end.rejected",
        "auth.refused",
        "session.stopped",
    ];
    // The last events (the stop's) land within moments.
    let seen = turnstile_tests::wait_until("every kind", Duration::from_secs(30), || async {
        let kinds: BTreeSet<String> = stack.events().await?.into_iter().map(|e| e.kind).collect();
        Ok(want.iter().all(|k| kinds.contains(*k)).then_some(()))
    })
    .await;
    let kinds = crate::asyncapi::check_events(stack).await?;
    let missing: Vec<&&str> = want.iter().filter(|k| !kinds.contains(**k)).collect();
    ensure!(
        missing.is_empty(),
        "the scenario did not produce {missing:?} (saw {kinds:?}; {seen:?})"
    );
    // The retried attempt's start is an event of its own, not a repeat of the first.
    let starts = stack
        .events()
        .await?
        .into_iter()
        .filter(|e| e.kind == "run.started" && e.data["run"] == failing.id.as_str())
        .count();
    ensure!(
        starts == 2,
        "the retried run started {starts} time(s) in TS_EVENTS"
    );
    eprintln!(
        "asyncapi: {} event kinds observed and described: {kinds:?}",
        kinds.len()
    );
    Ok(())
}
