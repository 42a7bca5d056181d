//! R15: malformed lane items are refused with a clear reason, and the lane keeps serving.

use std::time::Duration;
use turnstile_shared::api::ErrorCode;

use anyhow::{ensure, Context, Result};
use turnstile_shared::records::TurnState;
use turnstile_shared::subjects;

use crate::stack::{report, Stack};

/// R15: malformed lane items and items of an unknown version are refused, and the lane goes
/// on to the next item. A refused item is removed from the lane like a done one, so the
/// stranded-lane sweep (every second here) never hands it out again to be refused again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_unknown_version_lane_items_are_refused_and_the_lane_goes_on() -> Result<()> {
    let mut stack = Stack::start_with(&["a"], &["h1"], &[("TURNSTILE_SWEEP_EVERY", "1s")]).await?;
    let r = bad_items(&mut stack).await;
    report(&stack, r)
}

async fn bad_items(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("target", None).await?;
    let other = stack.create_session("bystander", None).await?;
    let lane = subjects::lane(&s);
    stack
        .js
        .publish(lane.clone(), "{not json".into())
        .await?
        .await?;
    let future = serde_json::json!({
        "v": 99, "id": "x", "type": "lane.turn", "at": "2026-11-29T00:00:00.000Z",
        "session": s.to_string(), "data": { "turn": "trn_x", "text": "from the future" }
    });
    stack
        .js
        .publish(lane.clone(), serde_json::to_vec(&future)?.into())
        .await?
        .await?;
    let good = stack.send(&s, "after the bad ones").await?;
    let by = stack.send(&other, "unaffected").await?;
    for t in [&good, &by] {
        let rec = stack.wait_turn(t, Duration::from_secs(30)).await?;
        ensure!(
            matches!(rec.state, TurnState::Completed { .. }),
            "{t}: {:?}",
            rec.state
        );
    }
    // Nothing of the lane stays stored: the refused items are removed as the done one is.
    let lanes = stack.js.get_stream(subjects::LANE_STREAM).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while let Ok(left) = lanes
        .direct_get_next_for_subject(lane.as_str(), Some(1))
        .await
    {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "lane item {} still stored 15 s after its lane went on: {}",
            left.sequence,
            String::from_utf8_lossy(&left.payload)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let events = stack.events().await?;
    let rejected: Vec<String> = events
        .iter()
        .filter(|e| e.kind == "lane.rejected" && e.session.as_ref() == Some(&s))
        .map(|e| e.data["reason"].as_str().unwrap_or_default().to_string())
        .collect();
    ensure!(
        rejected.len() == 2,
        "expected two lane.rejected events, got {rejected:?}"
    );
    ensure!(
        rejected[0].contains("not a JSON"),
        "reason: {}",
        rejected[0]
    );
    ensure!(
        rejected[1].contains("version 99 is not supported"),
        "reason: {}",
        rejected[1]
    );
    // Both are kept on the dead-letter subject with the reason in a header.
    let dlq = stack.js.get_stream(subjects::DEADLETTER_STREAM).await?;
    let first = dlq
        .direct_get_first_for_subject(subjects::lane_deadletter(&s))
        .await
        .context("first dead letter")?;
    let reason = first
        .headers
        .get(subjects::REASON_HEADER)
        .map(|v| v.to_string())
        .unwrap_or_default();
    ensure!(
        reason.contains("not a JSON"),
        "dead-letter reason header: {reason:?}"
    );
    ensure!(
        &first.payload[..] == b"{not json",
        "dead letter keeps the payload"
    );
    // The service that refused them is still up.
    let lane_proc = stack.lanes.get_mut("a").context("replica a")?;
    ensure!(
        lane_proc.try_exit_status()?.is_none(),
        "session-lane exited"
    );
    Ok(())
}

/// R15 at the transport: an unreadable command on a host's subject is dead-lettered with an
/// event, and the host keeps typing everyone's turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_transport_commands_are_refused_and_the_host_goes_on() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = bad_command(&mut stack).await;
    report(&stack, r)
}

async fn bad_command(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("on-h1", Some("h1")).await?;
    let host = "h1".parse()?;
    // Put where only the session-lane may: the host's command queue.
    stack
        .js_as("session-lane")
        .await?
        .publish(subjects::transport(&host, "turn"), "garbage".into())
        .await?
        .await?;
    let t = stack.send(&s, "still typed").await?;
    stack.all_complete(&[t]).await?;
    let dlq = stack.js.get_stream(subjects::DEADLETTER_STREAM).await?;
    let dead = dlq
        .direct_get_first_for_subject(subjects::transport_deadletter(&host))
        .await
        .context("transport dead letter")?;
    ensure!(
        &dead.payload[..] == b"garbage",
        "dead letter keeps the payload"
    );
    let events = stack.events().await?;
    let rejected = events
        .iter()
        .find(|e| e.kind == "transport.rejected")
        .context("no transport.rejected event")?;
    let reason = rejected.data["reason"].as_str().unwrap_or_default();
    ensure!(reason.contains("not a JSON"), "reason: {reason}");
    Ok(())
}

/// R15 for the broker and the scheduler: unreadable step and schedule requests get a clear
/// `bad_request`, an unreadable execution end is dead-lettered with an `end.rejected` event,
/// and both services go on serving (a real step still runs and comes back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_step_ends_and_requests_are_refused_and_the_broker_goes_on() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = bad_broker_input(&mut stack).await;
    report(&stack, r)
}

async fn bad_broker_input(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::api::{self, ApiError};
    use turnstile_shared::principal::Principal;
    use turnstile_shared::subjects::api as subj;
    let refused = |r: Result<serde_json::Value, ApiError>| match r {
        Err(e) if e.code == ErrorCode::BadRequest => Ok(e.message),
        other => Err(anyhow::anyhow!("expected bad_request, got {other:?}")),
    };
    // Not a step request at all (once the broker answers), and a command step without a
    // program.
    let client = stack.client.clone();
    let first = turnstile_tests::wait_until("the broker", Duration::from_secs(20), || {
        let client = client.clone();
        async move {
            let r = api::call::<_, serde_json::Value>(
                &client,
                &Principal::Operator.steps(subj::START),
                &serde_json::json!({"x": 1}),
                crate::stack::API,
            )
            .await;
            Ok(match r {
                Err(e) if e.code == ErrorCode::Unavailable || e.code == ErrorCode::Timeout => None,
                other => Some(other),
            })
        }
    })
    .await?;
    let msg = refused(first)?;
    ensure!(msg.contains("invalid request"), "{msg}");
    let s = stack.create_session("steady", None).await?;
    let caller = stack.caller(&s).await?;
    let no_program = serde_json::json!({
        "caller": caller, "name": "empty", "work": {"kind": "command", "argv": []}
    });
    let msg = refused(
        api::call(
            &stack.client,
            &Principal::of(&caller).steps(subj::START),
            &no_program,
            crate::stack::API,
        )
        .await,
    )?;
    ensure!(msg.contains("program"), "{msg}");
    // A schedule with a cron expression that is not one.
    let mut bad = crate::stack::schedule("broken", "61 * * * *", &s, &["x"]);
    bad.tz = "UTC".into();
    let msg =
        refused(api::call(&stack.client, subj::SCHEDULES_ADD, &bad, crate::stack::API).await)?;
    ensure!(msg.contains("61"), "the error names the bad field: {msg}");
    // An unreadable end on the broker's durable queue.
    stack
        .js_as("notification-broker")
        .await?
        .publish(
            subjects::step_ended(&turnstile_shared::StepId::new().into()),
            "{garbage".into(),
        )
        .await?
        .await?;
    stack
        .wait_events("end.rejected", Duration::from_secs(20), |ev| {
            ev.iter().any(|e| e.kind == "end.rejected").then_some(())
        })
        .await?;
    // Still serving: a real step runs and its result comes back.
    let turn = stack.send(&s, "!step fine 200ms\n!sleep 1s").await?;
    stack.all_complete(&[turn]).await?;
    let d = crate::stack::wait_deliveries(stack, &s, 1, Duration::from_secs(20)).await?;
    ensure!(
        crate::stack::listed_steps(&d[0].text).len() == 1,
        "{}",
        d[0].text
    );
    Ok(())
}
