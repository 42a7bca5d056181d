//! Child results come back to the conversation that owns them, once, in one batch (R2, R3,
//! R6): completions wait while the lane is held, then one delivery turn hands them all over.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::records::TurnState;
use turnstile_shared::{ExecutionId, SessionId};

use crate::stack::{listed_steps, report, Stack};

/// R2, R3: a 60 s turn starts 10 steps that all finish within it; their results wait for the
/// turn's end and come back in one delivery after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_steps_in_a_long_turn_come_back_in_one_delivery_after_it() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = ten_steps(&mut stack, 60).await;
    report(&stack, r)
}

async fn ten_steps(stack: &mut Stack, turn_secs: u64) -> Result<()> {
    let s = stack.create_session("plat-113", None).await?;
    let mut text = String::from("work through ten jobs in the background\n");
    for i in 1..=10 {
        text.push_str(&format!("!step job-{i} {}ms\n", 300 * i));
    }
    text.push_str(&format!("!sleep {turn_secs}s\n!reply all started"));
    let turn = stack.send(&s, &text).await?;
    let turn_exec = ExecutionId::from(&turn);

    // All ten finish while the turn still holds the lane.
    let tree = crate::stack::wait_until_tree(stack, &turn_exec, Duration::from_secs(45), |t| {
        t.nodes.len() == 10 && t.nodes.iter().all(|n| n.record.status.is_terminal())
    })
    .await?;
    let steps: Vec<String> = tree.nodes.iter().map(|n| n.record.id.to_string()).collect();
    ensure!(
        !stack
            .turn(&turn)
            .await?
            .context("turn")?
            .state
            .is_terminal(),
        "the turn ended before its steps did; lengthen it"
    );
    // A delivery waits on the lane, queued, and is nobody's running child (R2).
    let delivery_queued = stack
        .wait_events("delivery.queued", Duration::from_secs(20), |ev| {
            ev.iter()
                .any(|e| e.kind == "delivery.queued" && e.session.as_ref() == Some(&s))
                .then_some(())
        })
        .await;
    delivery_queued?;
    let view = stack.show(&s).await?;
    ensure!(view.busy, "the long turn holds the lane");
    ensure!(
        view.in_flight.as_ref().map(|t| &t.id) == Some(&turn),
        "the turn in flight is the long turn, not a delivery: {:?}",
        view.in_flight
    );
    ensure!(
        view.queued == 1,
        "one delivery waits, queued: {}",
        view.queued
    );
    let tree = stack.tree(&turn_exec).await?;
    ensure!(
        tree.nodes.len() == 10
            && tree
                .nodes
                .iter()
                .all(|n| n.record.kind == turnstile_shared::execution::ExecKind::Step),
        "the turn's children are its ten steps only: {:?}",
        tree.nodes
            .iter()
            .map(|n| (&n.record.id, n.record.kind))
            .collect::<Vec<_>>()
    );
    let events = stack.events().await?;
    ensure!(
        events
            .iter()
            .filter(|e| e.kind == "turn.started" && e.session.as_ref() == Some(&s))
            .count()
            == 1,
        "no delivery started during the turn"
    );

    // After the turn: exactly one delivery turn, carrying all ten.
    let done = stack
        .wait_turn(&turn, Duration::from_secs(turn_secs + 30))
        .await?;
    ensure!(
        matches!(done.state, TurnState::Completed { .. }),
        "{:?}",
        done.state
    );
    let deliveries = crate::stack::wait_deliveries(stack, &s, 1, Duration::from_secs(30)).await?;
    let d = &deliveries[0];
    ensure!(
        matches!(d.state, TurnState::Completed { .. }),
        "delivery: {:?}",
        d.state
    );
    let mut listed = listed_steps(&d.text);
    listed.sort();
    let mut expected = steps.clone();
    expected.sort();
    ensure!(
        listed == expected,
        "delivery lists {listed:?}, steps were {expected:?}"
    );
    // Nothing more is delivered, and the agent got exactly two messages.
    let transcript = stack.transcript(&s).await?;
    ensure!(transcript.len() == 2, "messages: {transcript:?}");
    ensure!(
        transcript[1] == d.text,
        "the agent got the delivery message as typed"
    );
    ensure!(
        stack.delivery_turns(&s).await?.len() == 1,
        "exactly one delivery turn"
    );
    Ok(())
}

/// R3: 1,000 steps finishing within one turn arrive in ceil(1000 / cap) delivery
/// turns, each listed exactly once, none lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_steps_arrive_in_as_few_deliveries_as_the_cap_allows() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = thousand(&mut stack).await;
    report(&stack, r)
}

async fn thousand(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::delivery::DELIVERY_CAP;
    const N: usize = 1000;
    let s = stack.create_session("bulk", None).await?;
    let turn = stack
        .send(&s, &format!("!step bulk 1s --count {N}\n!sleep 25s"))
        .await?;
    let turn_exec = ExecutionId::from(&turn);
    let tree = crate::stack::wait_until_tree(stack, &turn_exec, Duration::from_secs(60), |t| {
        t.nodes.len() == N && t.nodes.iter().all(|n| n.record.status.is_terminal())
    })
    .await?;
    ensure!(
        !stack
            .turn(&turn)
            .await?
            .context("turn")?
            .state
            .is_terminal(),
        "the turn ended before its 1,000 steps did; lengthen it"
    );
    let expected_deliveries = N.div_ceil(DELIVERY_CAP);
    let deliveries =
        crate::stack::wait_deliveries(stack, &s, expected_deliveries, Duration::from_secs(90))
            .await?;
    let mut listed: Vec<String> = deliveries
        .iter()
        .flat_map(|d| listed_steps(&d.text))
        .collect();
    ensure!(
        listed.len() == N,
        "{} results listed, want {N}",
        listed.len()
    );
    listed.sort();
    listed.dedup();
    ensure!(listed.len() == N, "a result was listed twice");
    let mut steps: Vec<String> = tree.nodes.iter().map(|n| n.record.id.to_string()).collect();
    steps.sort();
    ensure!(
        listed == steps,
        "the deliveries list exactly the turn's steps"
    );
    // No further delivery comes (give the lane a turn to prove it is idle).
    let last = stack.send(&s, "anything else?").await?;
    stack.all_complete(&[last]).await?;
    ensure!(
        stack.delivery_turns(&s).await?.len() == expected_deliveries,
        "exactly {expected_deliveries} delivery turns"
    );
    Ok(())
}

/// R3, R14: the broker is SIGKILLed between a step's end and its delivery;
/// then, with the delivery turn completed but its completions not yet acked, the lane replica
/// (the service that acks them) and the broker are both SIGKILLed. Every result reaches the
/// agent exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_broker_and_lane_hand_every_result_over_exactly_once() -> Result<()> {
    // Every agent message takes 1 s, so the delivery turn can be caught while it runs.
    let mut stack = Stack::start_with(&["a"], &["h1"], &[("TURNSTILE_MOCK_THINK", "1s")]).await?;
    let r = broker_and_lane_killed(&mut stack).await;
    report(&stack, r)
}

async fn broker_and_lane_killed(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("faults", None).await?;

    // 1. The step ends while the broker is dead; its report waits for the restarted broker.
    let t1 = stack.send(&s, "!step first 1500ms\n!sleep 4s").await?;
    let t1x = ExecutionId::from(&t1);
    let tree = crate::stack::wait_until_tree(stack, &t1x, Duration::from_secs(20), |t| {
        t.nodes.len() == 1 && t.nodes[0].record.status.name() == "running"
    })
    .await?;
    let first = tree.nodes[0].record.id.clone();
    stack.brokers.get_mut("b1").context("b1")?.kill().await?;
    stack.wait_turn(&t1, Duration::from_secs(30)).await?;
    ensure!(
        stack.exec(&first).await?.context("first")?.status.name() == "running",
        "with the broker dead, the step's end is not recorded yet"
    );
    stack.spawn_broker("b2")?;
    let d1 = crate::stack::wait_deliveries(stack, &s, 1, Duration::from_secs(40)).await?;
    ensure!(listed_steps(&d1[0].text) == vec![first.to_string()]);

    // 2. The second delivery turn completes while the lane replica is frozen, so its
    // completions are not acked; then the lane and the broker die.
    let t2 = stack.send(&s, "!step second 500ms\n!sleep 2s").await?;
    stack.wait_turn(&t2, Duration::from_secs(30)).await?;
    let running = wait_delivery_running(stack, &s, 2).await?;
    stack.freeze_lane("a")?;
    let done = stack.wait_turn(&running, Duration::from_secs(30)).await?;
    ensure!(
        matches!(done.state, TurnState::Completed { .. }),
        "{:?}",
        done.state
    );
    let pending = crate::stack::completion_backlog(stack, &s).await?;
    ensure!(
        pending > 0,
        "the frozen lane had not acked the carried completion yet"
    );
    stack.kill_lane("a").await?;
    stack.brokers.get_mut("b2").context("b2")?.kill().await?;
    stack.spawn_broker("b3")?;
    stack.spawn_lane("a2")?;
    turnstile_tests::wait_until(
        "carried completions acked",
        Duration::from_secs(30),
        || async { Ok((crate::stack::completion_backlog(stack, &s).await? == 0).then_some(())) },
    )
    .await?;

    // 3. The lane goes on; nothing is handed over a second time.
    let t3 = stack.send(&s, "last message").await?;
    stack.all_complete(&[t3]).await?;
    let deliveries = stack.delivery_turns(&s).await?;
    ensure!(
        deliveries.len() == 2,
        "two delivery turns, got {}",
        deliveries.len()
    );
    let transcript = stack.transcript(&s).await?;
    let handed: Vec<String> = transcript.iter().flat_map(|m| listed_steps(m)).collect();
    ensure!(
        handed.len() == 2,
        "each result handed over once: {handed:?}"
    );
    ensure!(handed[0] == first.to_string(), "{handed:?}");
    ensure!(transcript.len() == 5, "messages: {transcript:?}");
    Ok(())
}

/// The session's delivery turn number `n` (1-based), once it is being typed.
async fn wait_delivery_running(
    stack: &Stack,
    s: &turnstile_shared::SessionId,
    n: usize,
) -> Result<turnstile_shared::TurnId> {
    turnstile_tests::wait_until("delivery turn running", Duration::from_secs(30), || async {
        let d = stack.delivery_turns(s).await?;
        Ok(d.get(n - 1)
            .and_then(|r| matches!(r.state, TurnState::Running { .. }).then(|| r.id.clone())))
    })
    .await
}

/// The lane writes a delivery turn's record and sends its transport command at once. A
/// command that arrives first makes the transport record the turn itself, from the command,
/// with the same carried list, before it types anything (R14): what a delivery carries is
/// never typed without being recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_command_ahead_of_its_record_is_recorded_with_what_it_carries() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = command_ahead(&mut stack).await;
    report(&stack, r)
}

async fn command_ahead(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::records::{Carried, CarriedCompletion, TurnCommand};
    use turnstile_shared::{DeliveryId, StepId};
    let s = stack.create_session("ahead", None).await?;
    let host = stack.session_record(&s).await?.host;
    let delivery = DeliveryId::new();
    let turn = delivery.turn();
    let carried = Carried {
        delivery,
        completions: vec![CarriedCompletion {
            execution: StepId::new().into(),
            seq: 1,
        }],
    };
    let text = "a delivery whose record is not written yet";
    let command = TurnCommand {
        session: s.clone(),
        turn: turn.clone(),
        text: text.into(),
        delivery: Some(carried.clone()),
        known: None,
        unrecorded: false,
    };
    ensure!(
        stack.turn(&turn).await?.is_none(),
        "no record before the command"
    );
    // Sent as the lane sends it, under the lane's identity.
    stack.send_command(&host, &command).await?;
    let done = stack.wait_turn(&turn, Duration::from_secs(30)).await?;
    ensure!(
        matches!(done.state, TurnState::Completed { .. }),
        "{:?}",
        done.state
    );
    ensure!(
        done.delivery.as_ref() == Some(&carried),
        "the transport recorded {:?}, not the command's carried list",
        done.delivery
    );
    let transcript = stack.transcript(&s).await?;
    ensure!(
        crate::stack::count(&transcript, text) == 1,
        "typed once: {transcript:?}"
    );
    Ok(())
}

/// A step started while a turn holds the lane, on an external queue nobody serves (its end is
/// the test's to make), after which the lane is idle again.
async fn idle_with_a_step(
    stack: &Stack,
    name: &str,
    queue: &str,
) -> Result<(
    turnstile_shared::SessionId,
    turnstile_shared::execution::ExecutionRecord,
)> {
    use turnstile_shared::execution::Scope;
    use turnstile_shared::step_api::{StartStep, StepKind};
    let s = stack.create_session(name, None).await?;
    let holder = stack.send(&s, "hold the lane\n!sleep 2s").await?;
    stack
        .wait_turn_state(&holder, Duration::from_secs(20), |r| {
            matches!(r.state, TurnState::Running { .. })
        })
        .await?;
    let step = stack
        .start_step(&StartStep {
            caller: stack.caller(&s).await?,
            name: format!("{name}-step"),
            scope: Scope::Session,
            work: StepKind::External {
                queue: queue.into(),
                input: serde_json::Value::Null,
            },
            id: None,
        })
        .await?;
    stack.all_complete(&[holder]).await?;
    stack.wait_idle(&s).await?;
    Ok((s, step))
}

/// A router publishes the lane item beside the completion's store, so the item can reach the
/// lane first: the delivery waits for the completion that armed it (R3) instead of finding
/// nothing, clearing its marker and leaving the completion behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_that_overtakes_its_completion_waits_for_it() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = item_first(&mut stack).await;
    report(&stack, r)
}

async fn item_first(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::{arming, subjects};
    let (s, step) = idle_with_a_step(stack, "overtaken", "nobody").await?;
    // The broker's half, by hand and out of order: the delivery armed naming the step first,
    // its end recorded and its completion stored only once the lane is waiting for it.
    let js = stack.js_as("notification-broker").await?;
    let (marker, rev) = claim_by_hand(&js, &s).await?;
    arming::publish_item(&js, &s, &marker, rev, Some(&step.id)).await?;
    let delivery = marker.delivery;
    let completions = stack.js.get_stream(subjects::COMPLETION_STREAM).await?;
    turnstile_tests::wait_until(
        "the delivery to wait for the completion that armed it",
        Duration::from_secs(10),
        || async {
            let info = completions
                .consumer_info(subjects::completion_consumer(&s))
                .await?;
            Ok((info.num_waiting > 0).then_some(()))
        },
    )
    .await?;
    let record = end_by_hand(stack, &step.id, "done", chrono::Utc::now()).await?;
    store_by_hand(&js, &s, &record).await?;
    let done = stack
        .wait_turn(&delivery.turn(), Duration::from_secs(20))
        .await?;
    ensure!(
        matches!(done.state, TurnState::Completed { .. }),
        "{:?}",
        done.state
    );
    let carried = carried_by(&done);
    ensure!(carried == vec![step.id.clone()], "carried {carried:?}");
    ensure!(
        listed_steps(&done.text) == vec![step.id.to_string()],
        "{}",
        done.text
    );
    all_acked(stack, &s).await
}

/// A worker's end is recorded beside the store of its message on the ended queue. If that
/// store failed after the record was written, the worker (told its report failed) reports
/// again: the report finds the end recorded and stores the message then, so the end is still
/// routed and its result handed over (R3, R14).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_that_finds_its_end_recorded_but_not_queued_queues_it() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = recorded_not_queued(&mut stack).await;
    report(&stack, r)
}

async fn recorded_not_queued(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::execution::{ExecStatus, ExecutionRecord, StepResult};
    use turnstile_shared::step_api::Report;
    let (s, step) = idle_with_a_step(stack, "requeued", "requeue").await?;
    // The worker: takes the work, reports it started.
    let worker = ExternalWorker::take(stack, "requeue").await?;
    let report_as_worker = |report: Report| worker.report(report);
    report_as_worker(Report::Started {
        worker: "w1".into(),
    })
    .await?;
    // Its end recorded as the broker records it, with no message on the ended queue: what a
    // store that failed beside the write leaves.
    let result = StepResult {
        exit_code: Some(0),
        summary: "done".into(),
        output: vec![],
    };
    let kv = stack
        .js_as("notification-broker")
        .await?
        .get_key_value(turnstile_shared::subjects::EXECUTIONS_BUCKET)
        .await?;
    let entry = kv
        .entry(step.id.as_str())
        .await?
        .context("the step's record")?;
    let mut record: ExecutionRecord = serde_json::from_slice(&entry.value)?;
    ensure!(
        matches!(record.status, ExecStatus::Running { .. }),
        "{:?}",
        record.status
    );
    record.status = ExecStatus::Completed {
        started_at: record.status.started_at(),
        ended_at: chrono::Utc::now(),
        result: result.clone(),
    };
    kv.update(
        step.id.as_str(),
        serde_json::to_vec(&record)?.into(),
        entry.revision,
    )
    .await?;
    // The worker reports again; its result reaches the owner.
    let ack = report_as_worker(Report::Completed { result }).await?;
    ensure!(ack.stop && ack.status == "completed", "{ack:?}");
    let delivered = crate::stack::wait_deliveries(stack, &s, 1, Duration::from_secs(20)).await?;
    ensure!(
        listed_steps(&delivered[0].text) == vec![step.id.to_string()],
        "{}",
        delivered[0].text
    );
    Ok(())
}

/// The broker sends a completion and its lane item beside the end's registry write, before
/// it knows the write landed (R14 still holds: nothing acts on the end before the registry
/// has it). The lane hands the completion over only once the registry holds the end, and
/// says what the registry says, whatever the message claims (R8, R12): here the message
/// claims an outcome the registry never recorded, and the end lands only once the delivery
/// is waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_sent_ahead_of_its_end_is_handed_over_as_the_registry_records_it() -> Result<()>
{
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = sent_ahead(&mut stack).await;
    report(&stack, r)
}

/// A session holding a step that has not ended, and the broker's half of routing its end
/// ahead, by hand: the completion as the end was to write it (its summary `says`), the marker
/// and the item naming the end, which is at `at`.
async fn routed_ahead_by_hand(
    stack: &Stack,
    name: &str,
    says: &str,
) -> Result<(
    SessionId,
    turnstile_shared::execution::ExecutionRecord,
    chrono::DateTime<chrono::Utc>,
    turnstile_shared::delivery::DeliveryMarker,
)> {
    use turnstile_shared::arming::{self, First};
    use turnstile_shared::delivery::Completion;
    use turnstile_shared::subjects;
    let (s, step) = idle_with_a_step(stack, name, "nobody").await?;
    let js = stack.js_as("notification-broker").await?;
    let at = chrono::Utc::now();
    let sent = Completion {
        execution: step.id.clone(),
        name: step.name.clone(),
        status: "completed".into(),
        summary: says.into(),
        ended_at: at,
    };
    turnstile_shared::events::publish_durable(
        &js,
        subjects::completion(&s, &step.id),
        &sent.envelope(&s)?,
        None,
    )
    .await?;
    let (marker, _) = claim_by_hand(&js, &s).await?;
    let first = First {
        execution: &step.id,
        ended_at: Some(at),
    };
    arming::publish_item_ahead(&js, &s, &marker, first).await?;
    Ok((s, step, at, marker))
}

async fn sent_ahead(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::subjects;
    let (s, step, at, marker) = routed_ahead_by_hand(stack, "ahead", "as the message says").await?;
    // The delivery holds the completion, waiting for the registry to have its end.
    let completions = stack.js.get_stream(subjects::COMPLETION_STREAM).await?;
    turnstile_tests::wait_until(
        "the delivery to take the completion",
        Duration::from_secs(10),
        || async {
            let info = completions
                .consumer_info(subjects::completion_consumer(&s))
                .await?;
            Ok((info.num_ack_pending == 1).then_some(()))
        },
    )
    .await?;
    ensure!(
        stack.delivery_turns(&s).await?.is_empty(),
        "handed over before the registry held the end"
    );
    end_by_hand(stack, &step.id, "as the registry says", at).await?;
    let done = stack
        .wait_turn(&marker.delivery.turn(), Duration::from_secs(20))
        .await?;
    ensure!(
        matches!(done.state, TurnState::Completed { .. }),
        "{:?}",
        done.state
    );
    ensure!(
        listed_steps(&done.text) == vec![step.id.to_string()]
            && done.text.contains("as the registry says")
            && !done.text.contains("as the message says"),
        "{}",
        done.text
    );
    all_acked(stack, &s).await
}

/// A completion sent ahead whose end reaches the registry only after its delivery stopped
/// waiting for it (a slow registry write) is left pending, and the next delivery is armed
/// for it at once: it is handed over when its end lands, with nothing routed again (R3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_whose_end_lands_late_is_handed_over_by_the_next_delivery() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = ends_late(&mut stack).await;
    report(&stack, r)
}

async fn ends_late(stack: &mut Stack) -> Result<()> {
    let (s, step, at, _) = routed_ahead_by_hand(stack, "late", "late").await?;
    // The delivery waits for the end, gives up, and leaves the completion pending.
    let log = stack
        .lanes
        .get("a")
        .context("replica a")?
        .log_path()
        .to_owned();
    turnstile_tests::wait_until(
        "the delivery to leave the completion pending",
        Duration::from_secs(20),
        || async {
            let text = std::fs::read_to_string(&log)?;
            Ok(text
                .contains("a completion whose end the registry does not hold yet")
                .then_some(()))
        },
    )
    .await?;
    ensure!(
        stack.delivery_turns(&s).await?.is_empty(),
        "handed over before the registry held the end"
    );
    end_by_hand(stack, &step.id, "late", at).await?;
    let delivered = crate::stack::wait_deliveries(stack, &s, 1, Duration::from_secs(20)).await?;
    ensure!(
        listed_steps(&delivered[0].text) == vec![step.id.to_string()],
        "{}",
        delivered[0].text
    );
    // One delivery armed for it, which waited for its redelivery: not a delivery after
    // another finding nothing until the nak's delay ran out.
    let armed = stack
        .events()
        .await?
        .iter()
        .filter(|e| e.kind == "delivery.queued" && e.session.as_ref() == Some(&s))
        .count();
    ensure!(armed == 1, "{armed} deliveries armed for one completion");
    all_acked(stack, &s).await
}

/// An item sent ahead of its marker's create finds, when the create fails, a delivery armed
/// already: it is an extra delivery on the lane. Running after the armed one, which carried
/// its completion, it carries nothing (never a result twice, R3) and does not wait for the
/// completion it names, which was handed over (R13: nothing waits on what has ended).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extra_item_sent_ahead_carries_nothing_twice_and_waits_for_nothing() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = extra_ahead(&mut stack).await;
    report(&stack, r)
}

async fn extra_ahead(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::arming::{self, First};
    use turnstile_shared::delivery::DeliveryMarker;
    use turnstile_shared::DeliveryId;
    let (s, step) = idle_with_a_step(stack, "extra", "nobody").await?;
    let js = stack.js_as("notification-broker").await?;
    let record = end_by_hand(stack, &step.id, "done", chrono::Utc::now()).await?;
    store_by_hand(&js, &s, &record).await?;
    // The armed delivery, then an item sent ahead whose marker's create found it armed.
    let (marker, rev) = claim_by_hand(&js, &s).await?;
    arming::publish_item(&js, &s, &marker, rev, None).await?;
    let unarmed = DeliveryMarker {
        delivery: DeliveryId::new(),
        armed_at: chrono::Utc::now(),
    };
    let first = First {
        execution: &step.id,
        ended_at: record.status.ended_at(),
    };
    arming::publish_item_ahead(&js, &s, &unarmed, first).await?;
    turnstile_tests::wait_until("both items done with", Duration::from_secs(20), || async {
        let v = stack.show(&s).await?;
        let left = stack.lane_items(&s).await?;
        Ok((!v.busy && v.queued == 0 && left.is_empty()).then_some(()))
    })
    .await?;
    let deliveries = stack.delivery_turns(&s).await?;
    ensure!(
        deliveries.len() == 1 && deliveries[0].id == marker.delivery.turn(),
        "one delivery turn, the armed one's: {deliveries:?}"
    );
    ensure!(
        listed_steps(&deliveries[0].text) == vec![step.id.to_string()],
        "{}",
        deliveries[0].text
    );
    let log = stack.lane_log("a")?;
    ensure!(
        !log.contains("did not arrive"),
        "the extra delivery waited for a completion handed over already"
    );
    Ok(())
}

/// A delivery full to the cap before the completion that armed it is stored goes without it,
/// and the next delivery is armed naming it, so it waits for that completion in turn: a
/// completion whose item overtook it is never left with nothing armed for it (R3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_full_before_its_completion_arms_the_next_to_wait_for_it() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = full_first(&mut stack).await;
    report(&stack, r)
}

async fn full_first(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::delivery::{Completion, DELIVERY_CAP};
    use turnstile_shared::{arming, subjects, StepId};
    let (s, step) = idle_with_a_step(stack, "full", "nobody").await?;
    let js = stack.js_as("notification-broker").await?;
    // A cap's worth of completions of executions the registry does not know: they fill the
    // first delivery's fetch, and are refused (R8).
    for i in 0..DELIVERY_CAP {
        let bogus = Completion {
            execution: StepId::new().into(),
            name: format!("filler-{i}"),
            status: "completed".into(),
            summary: String::new(),
            ended_at: chrono::Utc::now(),
        };
        turnstile_shared::events::publish_durable(
            &js,
            subjects::completion(&s, &bogus.execution),
            &bogus.envelope(&s)?,
            None,
        )
        .await?;
    }
    let (marker, rev) = claim_by_hand(&js, &s).await?;
    arming::publish_item(&js, &s, &marker, rev, Some(&step.id)).await?;
    let delivery = marker.delivery;
    // The first delivery refuses the fillers and arms the next, which waits for the step's
    // completion: only then is it stored.
    let completions = stack.js.get_stream(subjects::COMPLETION_STREAM).await?;
    turnstile_tests::wait_until(
        "the next delivery to wait for the completion",
        Duration::from_secs(20),
        || async {
            let info = completions
                .consumer_info(subjects::completion_consumer(&s))
                .await?;
            Ok((info.num_waiting > 0 && info.num_pending == 0).then_some(()))
        },
    )
    .await?;
    let record = end_by_hand(stack, &step.id, "done", chrono::Utc::now()).await?;
    store_by_hand(&js, &s, &record).await?;
    let delivered = crate::stack::wait_deliveries(stack, &s, 1, Duration::from_secs(20)).await?;
    ensure!(
        delivered.len() == 1 && listed_steps(&delivered[0].text) == vec![step.id.to_string()],
        "{delivered:?}"
    );
    ensure!(
        delivered[0].id != delivery.turn(),
        "carried by the first delivery, which was full"
    );
    Ok(())
}

/// An end recorded again (its message redelivered after a lost ack, the other broker
/// replica's copy) routes again, which is harmless; but its completion may be handed over
/// already, so the delivery it arms names nothing to wait for: it must not hold the lane for
/// a completion that will never come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_end_routed_again_arms_a_delivery_that_waits_for_nothing() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = routed_again(&mut stack).await;
    report(&stack, r)
}

async fn routed_again(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::lane::LaneItem;
    use turnstile_shared::step_api::Ended;
    use turnstile_shared::subjects;
    let s = stack.create_session("again", None).await?;
    let t = stack.send(&s, "!step once 200ms\n!sleep 1s").await?;
    stack.all_complete(std::slice::from_ref(&t)).await?;
    let step = stack.tree(&ExecutionId::from(&t)).await?.nodes[0]
        .record
        .clone();
    let first = crate::stack::wait_deliveries(stack, &s, 1, Duration::from_secs(20)).await?;
    ensure!(
        listed_steps(&first[0].text) == vec![step.id.to_string()],
        "{}",
        first[0].text
    );
    stack.wait_idle(&s).await?;
    // The first delivery's item is removed once done, so the next item read is the repeat's.
    stack.wait_lane_emptied(&s).await?;
    // The same end again, under another message id (a copy the queue's de-duplication lets
    // through, as a redelivery is).
    // The lane frozen, so the item the repeat arms stays on it to be read.
    let lane_pid = stack.freeze_lane("a")?;
    let record = stack.exec(&step.id).await?.context("the step's record")?;
    let again = Ended {
        execution: step.id.clone(),
        status: record.status.clone(),
        known: None,
    }
    .envelope()?
    .with_id(format!("{}:ended-again", step.id));
    turnstile_shared::events::publish_durable(
        &stack.js_as("notification-broker").await?,
        subjects::step_ended(&step.id),
        &again,
        None,
    )
    .await?;
    let lanes = stack.js.get_stream(subjects::LANE_STREAM).await?;
    let item = turnstile_tests::wait_until(
        "the repeat's delivery item",
        Duration::from_secs(20),
        || async {
            Ok(lanes
                .direct_get_first_for_subject(subjects::lane(&s))
                .await
                .ok())
        },
    )
    .await;
    crate::stack::signal(lane_pid, rustix::process::Signal::CONT)?;
    match LaneItem::decode(&item?.payload, &s)? {
        LaneItem::Delivery(item) => ensure!(
            item.first.is_none(),
            "the repeat's delivery waits for {:?}, handed over already",
            item.first
        ),
        other => anyhow::bail!("expected a delivery item, got {other:?}"),
    }
    // Nothing is handed over twice.
    stack.wait_idle(&s).await?;
    let delivered = stack.delivery_turns(&s).await?;
    ensure!(delivered.len() == 1, "{delivered:?}");
    Ok(())
}

/// A report whose end the ended queue refuses to store is answered `unavailable` (which every
/// worker retries), not as a final refusal: the worker reports again once the queue takes
/// messages, and that report stores the end it finds recorded. The result reaches the owner
/// once (R3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_whose_end_cannot_be_stored_is_retried_not_refused() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = store_refused(&mut stack).await;
    report(&stack, r)
}

async fn store_refused(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::api::ErrorCode;
    use turnstile_shared::execution::StepResult;
    use turnstile_shared::step_api::Report;
    use turnstile_shared::subjects;
    let (s, step) = idle_with_a_step(stack, "refused-store", "refused").await?;
    let worker = ExternalWorker::take(stack, "refused").await?;
    let report_as_worker = |report: Report| worker.report(report);
    report_as_worker(Report::Started {
        worker: "w1".into(),
    })
    .await?;
    // The ended queue takes nothing an end's size for now.
    let steps = stack
        .js_as("admin")
        .await?
        .get_stream(subjects::STEP_STREAM)
        .await?;
    let restore = stack.refuse_writes(subjects::STEP_STREAM).await?;
    let result = StepResult {
        exit_code: Some(0),
        summary: "done".into(),
        output: vec![],
    };
    let refused = report_as_worker(Report::Completed {
        result: result.clone(),
    })
    .await
    .expect_err("the end could not be stored");
    ensure!(refused.code == ErrorCode::Unavailable, "{refused}");
    stack.restore_stream(restore).await?;
    let ack = report_as_worker(Report::Completed { result }).await?;
    ensure!(ack.stop && ack.status == "completed", "{ack:?}");
    let delivered = crate::stack::wait_deliveries(stack, &s, 1, Duration::from_secs(20)).await?;
    ensure!(
        listed_steps(&delivered[0].text) == vec![step.id.to_string()],
        "{}",
        delivered[0].text
    );
    // The end is on the queue now, and taken.
    turnstile_tests::wait_until("the end stored and taken", Duration::from_secs(20), || {
        let steps = steps.clone();
        async move {
            let ended = steps.consumer_info(subjects::BROKER_ENDED_CONSUMER).await?;
            Ok((ended.delivered.stream_sequence > 0
                && ended.num_pending == 0
                && ended.num_ack_pending == 0)
                .then_some(()))
        }
    })
    .await?;
    let once = stack.delivery_turns(&s).await?;
    ensure!(once.len() == 1, "handed over once: {once:?}");
    Ok(())
}

/// A delivery's first command asks the transport to record the turn itself (the lane writes
/// no record: one round trip off the completion path). The transport creates it running,
/// with the command's carried list, before it types (R14); a record already there (another
/// attempt's, here one already ended) makes that create lose, and nothing is typed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrecorded_delivery_is_recorded_by_its_transport_and_an_ended_one_never_typed(
) -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = unrecorded(&mut stack).await;
    report(&stack, r)
}

async fn unrecorded(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::records::{Carried, CarriedCompletion, TurnCommand, TurnRecord};
    use turnstile_shared::{subjects, DeliveryId, StepId};
    let s = stack.create_session("unrecorded", None).await?;
    let first = stack.send(&s, "first").await?;
    stack.all_complete(&[first]).await?;
    let host = stack.session_record(&s).await?.host;
    let carried = || Carried {
        delivery: DeliveryId::new(),
        completions: vec![CarriedCompletion {
            execution: StepId::new().into(),
            seq: 1,
        }],
    };
    let command = |carried: &Carried, text: &str| TurnCommand {
        session: s.clone(),
        turn: carried.delivery.turn(),
        text: text.into(),
        delivery: Some(carried.clone()),
        known: None,
        unrecorded: true,
    };
    let fresh = carried();
    let fresh_text = "a delivery nobody recorded";
    let ended = carried();
    let ended_text = "a delivery ended before its command came";
    let gone = TurnRecord {
        id: ended.delivery.turn(),
        session: s.clone(),
        text: ended_text.into(),
        queued_at: chrono::Utc::now(),
        delivery: Some(ended.clone()),
        parent: None,
        state: TurnState::Failed {
            ended_at: chrono::Utc::now(),
            reason: "transport_unavailable".into(),
            detail: "failed before its command came".into(),
            output: Vec::new(),
        },
    };
    stack
        .js_as("session-lane")
        .await?
        .get_key_value(subjects::TURNS_BUCKET)
        .await?
        .create(gone.id.as_str(), serde_json::to_vec(&gone)?.into())
        .await?;
    for c in [command(&ended, ended_text), command(&fresh, fresh_text)] {
        stack.send_command(&host, &c).await?;
    }
    let done = stack
        .wait_turn(&fresh.delivery.turn(), Duration::from_secs(30))
        .await?;
    ensure!(
        matches!(done.state, TurnState::Completed { .. }),
        "{:?}",
        done.state
    );
    ensure!(
        done.delivery.as_ref() == Some(&fresh),
        "the transport recorded {:?}, not the command's carried list",
        done.delivery
    );
    stack.wait_commands_handled(&host).await?;
    let transcript = stack.transcript(&s).await?;
    ensure!(
        crate::stack::count(&transcript, fresh_text) == 1,
        "typed once: {transcript:?}"
    );
    ensure!(
        crate::stack::count(&transcript, ended_text) == 0,
        "the ended delivery typed: {transcript:?}"
    );
    let after = stack
        .turn(&gone.id)
        .await?
        .context("the ended delivery's record")?;
    ensure!(after.state == gone.state, "rewritten: {:?}", after.state);
    Ok(())
}

/// The lane leaves a delivery turn's record to its transport, and writes it `queued` itself
/// only if the transport has not recorded it within a moment (so a lane killed then finds it
/// on the item's redelivery). A delivery sent to a host that died before taking its command
/// is recorded so by the lane, then failed `transport_unavailable` once the host's heartbeat
/// lapses (R9) instead of waited on; its completion stays pending (R3) until the host is back
/// and a later delivery hands it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_to_a_dead_host_fails_unavailable_and_its_completion_waits() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = dead_host_delivery(&mut stack).await;
    report(&stack, r)
}

async fn dead_host_delivery(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::{arming, subjects};
    let (s, step) = idle_with_a_step(stack, "dead-host", "nobody").await?;
    stack.transports.get_mut("h1").context("h1")?.kill().await?;
    // The broker's half, by hand: the end recorded and its completion stored, then the
    // delivery armed.
    let js = stack.js_as("notification-broker").await?;
    let record = end_by_hand(stack, &step.id, "done", chrono::Utc::now()).await?;
    store_by_hand(&js, &s, &record).await?;
    let turns = stack.js.get_key_value(subjects::TURNS_BUCKET).await?;
    let (marker, rev) = claim_by_hand(&js, &s).await?;
    let turn = marker.delivery.turn();
    let mut changes = turns.watch_with_history(turn.as_str()).await?;
    arming::publish_item(&js, &s, &marker, rev, Some(&step.id)).await?;
    let mut states = Vec::new();
    let failed = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(entry) = futures::StreamExt::next(&mut changes).await {
            let r: turnstile_shared::records::TurnRecord = serde_json::from_slice(&entry?.value)?;
            states.push(r.state.name().to_string());
            if r.state.is_terminal() {
                return Ok(r);
            }
        }
        anyhow::bail!("the turn watch ended")
    })
    .await
    .context("the dead host's delivery did not end")??;
    ensure!(
        states.first().map(String::as_str) == Some("queued"),
        "the lane records a delivery its transport has not taken: {states:?}"
    );
    match &failed.state {
        TurnState::Failed { reason, detail, .. } => {
            ensure!(reason == "transport_unavailable", "{reason}");
            ensure!(detail.contains("h1"), "{detail}");
        }
        other => anyhow::bail!("the dead host's delivery: {other:?}"),
    }
    ensure!(
        failed.delivery.as_ref().map(|d| d.completions.len()) == Some(1),
        "the failed delivery records what it carried: {:?}",
        failed.delivery
    );
    ensure!(
        crate::stack::completion_backlog(stack, &s).await? == 1,
        "the completion of a failed delivery stays pending"
    );
    // The host is back: the session's next turn end arms a delivery for what waits.
    stack.spawn_transport("h1")?;
    let again = stack.send(&s, "back again").await?;
    stack.all_complete(&[again]).await?;
    turnstile_tests::wait_until(
        "the waiting completion handed over",
        Duration::from_secs(30),
        || async { Ok((crate::stack::completion_backlog(stack, &s).await? == 0).then_some(())) },
    )
    .await?;
    let delivered: Vec<_> = stack
        .delivery_turns(&s)
        .await?
        .into_iter()
        .filter(|d| matches!(d.state, TurnState::Completed { .. }))
        .collect();
    ensure!(
        delivered.len() == 1 && listed_steps(&delivered[0].text) == vec![step.id.to_string()],
        "handed over once by a later delivery: {delivered:?}"
    );
    let transcript = stack.transcript(&s).await?;
    ensure!(
        crate::stack::count(&transcript, "back again") == 1,
        "{transcript:?}"
    );
    Ok(())
}

/// A delivery item redelivered after its lane replica died, finding no record of its turn
/// and nothing to carry (what the dead replica took is still held by it, or already handed
/// over): the turn is recorded failed `delivery_superseded` before the item is let go, so a
/// command its earlier attempt may have dispatched is never typed (R1, R14). Without that
/// record the lane would move on while that command could still be typed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_delivery_with_nothing_to_carry_is_superseded_not_left_to_type() -> Result<()>
{
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = superseded(&mut stack).await;
    report(&stack, r)
}

async fn superseded(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::records::{reason, Carried, TurnCommand};
    use turnstile_shared::{arming, subjects};
    let s = stack.create_session("superseded", None).await?;
    let warm = stack.send(&s, "warm-up").await?;
    stack.all_complete(&[warm]).await?;
    stack.spawn_lane("b")?;
    turnstile_tests::wait_lanes_pulled(&stack.js, &[&s], 2, Duration::from_secs(20)).await?;
    // Replica `a` holds the pin: frozen, it is handed the item and never acts on it.
    stack.freeze_lane("a")?;
    let js = stack.js_as("notification-broker").await?;
    let (marker, rev) = claim_by_hand(&js, &s).await?;
    arming::publish_item(&js, &s, &marker, rev, None).await?;
    let delivery = marker.delivery;
    let lane = stack.js.get_stream(subjects::LANE_STREAM).await?;
    turnstile_tests::wait_until(
        "the frozen replica to be handed the item",
        Duration::from_secs(10),
        || async {
            let info = lane.consumer_info(subjects::lane_consumer(&s)).await?;
            Ok((info.num_ack_pending == 1).then_some(()))
        },
    )
    .await?;
    stack.kill_lane("a").await?;
    let turn = delivery.turn();
    let failed = stack.wait_turn(&turn, Duration::from_secs(30)).await?;
    match &failed.state {
        TurnState::Failed { reason: r, .. } => {
            ensure!(r == reason::DELIVERY_SUPERSEDED, "{r}")
        }
        other => anyhow::bail!("the redelivered delivery: {other:?}"),
    }
    // The command the dead replica's attempt could have sent comes now: never typed.
    let host = stack.session_record(&s).await?.host;
    let text = "a superseded delivery";
    let command = TurnCommand {
        session: s.clone(),
        turn: turn.clone(),
        text: text.into(),
        delivery: Some(Carried {
            delivery: delivery.clone(),
            completions: Vec::new(),
        }),
        known: None,
        unrecorded: true,
    };
    stack.send_command(&host, &command).await?;
    let after = stack.send(&s, "after it").await?;
    stack.all_complete(&[after]).await?;
    stack.wait_commands_handled(&host).await?;
    let transcript = stack.transcript(&s).await?;
    ensure!(
        crate::stack::count(&transcript, text) == 0,
        "the superseded delivery typed: {transcript:?}"
    );
    Ok(())
}

/// A worker on an external queue that took one step's work, reporting on it as any worker
/// does (through the step report API, with the work's token).
struct ExternalWorker {
    client: async_nats::Client,
    item: turnstile_shared::step_api::StepWorkItem,
    subject: String,
}

impl ExternalWorker {
    async fn take(stack: &Stack, queue: &str) -> Result<Self> {
        use futures::StreamExt;
        use turnstile_shared::envelope::Envelope;
        use turnstile_shared::principal::Principal;
        use turnstile_shared::subjects::api as subj;
        use turnstile_shared::topology::{self, TopologyConfig};
        let consumer =
            topology::ensure_step_external_consumer(&stack.js, &TopologyConfig::default(), queue)
                .await?;
        let mut work = consumer.messages().await?;
        let msg = tokio::time::timeout(Duration::from_secs(10), work.next())
            .await
            .context("the step's work")?
            .context("work stream ended")??;
        let item: turnstile_shared::step_api::StepWorkItem =
            Envelope::decode(&msg.payload)?.data_as()?;
        let subject = Principal::Step(item.step.clone()).steps(subj::REPORT);
        Ok(Self {
            client: stack.client.clone(),
            item,
            subject,
        })
    }

    async fn report(
        &self,
        report: turnstile_shared::step_api::Report,
    ) -> Result<turnstile_shared::step_api::ReportAck, turnstile_shared::api::ApiError> {
        let req = turnstile_shared::step_api::StepReport {
            step: self.item.step.clone(),
            token: self.item.token.clone(),
            report,
        };
        turnstile_shared::api::call(&self.client, &self.subject, &req, crate::stack::API).await
    }
}

/// Until every completion of `s` is acked (handed over).
async fn all_acked(stack: &Stack, s: &SessionId) -> Result<()> {
    turnstile_tests::wait_until(
        "the carried completions acked",
        Duration::from_secs(20),
        || async { Ok((crate::stack::completion_backlog(stack, s).await? == 0).then_some(())) },
    )
    .await
}

/// The broker's first half of arming a delivery, by hand (`js` under the broker's identity):
/// the session's marker claimed, as on an idle lane.
async fn claim_by_hand(
    js: &async_nats::jetstream::Context,
    s: &SessionId,
) -> Result<(turnstile_shared::delivery::DeliveryMarker, u64)> {
    use turnstile_shared::{arming, topology};
    let buckets = topology::bind(js).await?;
    arming::claim(js, &buckets.deliveries, s, arming::Trust::YoungMarkers)
        .await?
        .context("nothing armed on an idle lane")
}

/// A completion of `record`'s end for `s`, stored as its router stores it (`js` under the
/// broker's identity).
async fn store_by_hand(
    js: &async_nats::jetstream::Context,
    s: &SessionId,
    record: &turnstile_shared::execution::ExecutionRecord,
) -> Result<()> {
    use turnstile_shared::delivery::Completion;
    turnstile_shared::events::publish_durable(
        js,
        turnstile_shared::subjects::completion(s, &record.id),
        &Completion::of(record).envelope(s)?,
        None,
    )
    .await?;
    Ok(())
}

/// The executions a delivery turn's record says it carried.
fn carried_by(turn: &turnstile_shared::records::TurnRecord) -> Vec<ExecutionId> {
    turn.delivery
        .iter()
        .flat_map(|d| d.completions.iter().map(|c| c.execution.clone()))
        .collect()
}

/// An execution's end written to the registry as the broker writes it (completed at `at`,
/// with `summary`), and nothing else: the test routes it by hand.
async fn end_by_hand(
    stack: &Stack,
    id: &ExecutionId,
    summary: &str,
    at: chrono::DateTime<chrono::Utc>,
) -> Result<turnstile_shared::execution::ExecutionRecord> {
    use turnstile_shared::execution::{ExecStatus, ExecutionRecord, StepResult};
    let kv = stack
        .js_as("notification-broker")
        .await?
        .get_key_value(turnstile_shared::subjects::EXECUTIONS_BUCKET)
        .await?;
    let entry = kv.entry(id.as_str()).await?.context("the record")?;
    let mut record: ExecutionRecord = serde_json::from_slice(&entry.value)?;
    ensure!(
        !record.status.is_terminal(),
        "ended already: {:?}",
        record.status
    );
    record.status = ExecStatus::Completed {
        started_at: record.status.started_at(),
        ended_at: at,
        result: StepResult {
            exit_code: Some(0),
            summary: summary.into(),
            output: vec![],
        },
    };
    kv.update(
        id.as_str(),
        serde_json::to_vec(&record)?.into(),
        entry.revision,
    )
    .await?;
    Ok(record)
}

/// R4 on a lane stream that keeps items until removed: a run item its lane acked, whose
/// removal never landed (the replica died in between), is not a run still on the lane. A
/// stale marker is claimed again, so a completion is armed rather than left waiting for a
/// run that ended.
#[tokio::test]
async fn a_finished_run_left_on_the_lane_does_not_keep_completions_unarmed() -> Result<()> {
    let stack = Stack::bare(&[]).await?;
    stack.provision().await?;
    let r = finished_run_left(&stack).await;
    report(&stack, r)
}

async fn finished_run_left(stack: &Stack) -> Result<()> {
    use futures::StreamExt;
    use turnstile_shared::delivery::DeliveryMarker;
    use turnstile_shared::lane::LaneItem;
    use turnstile_shared::runs::RunItem;
    use turnstile_shared::{arming, subjects, topology, DeliveryId, RunId};
    let js = stack.js_as("session-lane").await?;
    let buckets = topology::bind(&js).await?;
    let s = SessionId::new();
    let lane =
        topology::ensure_lane_consumer(&js, &topology::TopologyConfig::default(), &s).await?;
    let item = LaneItem::Run(RunItem {
        run: RunId::new(),
        attempt: 0,
    });
    turnstile_shared::events::publish_durable_at(&js, subjects::lane(&s), &item.to_envelope(&s)?)
        .await?;
    // A marker armed long ago, as a delivery that never came would leave.
    let stale = DeliveryMarker {
        delivery: DeliveryId::new(),
        armed_at: chrono::Utc::now() - chrono::Duration::minutes(1),
    };
    buckets.deliveries.put(s.as_str(), &stale).await?;
    let claim = || arming::claim(&js, &buckets.deliveries, &s, arming::Trust::OnlyTheLane);
    ensure!(
        claim().await?.is_none(),
        "a run waiting on the lane is the session's deliverer"
    );
    // The lane serves the run to its end and acks it; its removal is lost.
    let mut taken = lane
        .stream()
        .max_messages_per_batch(1)
        .group(subjects::LANE_GROUP)
        .messages()
        .await?;
    let msg = taken
        .next()
        .await
        .context("the run item")?
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    msg.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(
        stack.lane_items(&s).await?.len() == 1,
        "the acked run item is still stored"
    );
    let (marker, _) = claim()
        .await?
        .context("the stale marker was not claimed: the ended run counted as on the lane")?;
    ensure!(marker.delivery == stale.delivery, "{marker:?}");
    Ok(())
}

/// A worker's end report is written from the record the broker replica last wrote (its
/// `started` and heartbeats), without reading it first. The compare-and-set keeps that safe
/// (R14): a child appended to the step since keeps its place when the end is written, and a
/// cancellation recorded since still wins over the worker's later `completed`, which its
/// owner is then told nothing of: one completion, `cancelled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_end_written_without_a_read_keeps_a_later_child_and_loses_to_an_earlier_cancel(
) -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = unread_end(&mut stack).await;
    report(&stack, r)
}

async fn unread_end(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::execution::{Scope, StepResult};
    use turnstile_shared::principal::Principal;
    use turnstile_shared::step_api::{Caller, Cancelled, ExecRef, Report, StartStep, StepKind};
    use turnstile_shared::subjects::api as subj;
    let done = |summary: &str| Report::Completed {
        result: StepResult {
            exit_code: Some(0),
            summary: summary.into(),
            output: vec![],
        },
    };

    // Children appended after the worker's heartbeats: the next heartbeat's write and the
    // end's must keep them.
    let (s, parent) = idle_with_a_step(stack, "unread-child", "unread-child").await?;
    let worker = ExternalWorker::take(stack, "unread-child").await?;
    worker
        .report(Report::Started {
            worker: "w1".into(),
        })
        .await?;
    worker.report(Report::Heartbeat).await?;
    let child_of = |name: &str| StartStep {
        caller: Caller {
            session: None,
            step: Some(worker.item.step.clone()),
            token: worker.item.token.clone(),
        },
        name: name.into(),
        scope: Scope::Session,
        work: StepKind::External {
            queue: "nobody".into(),
            input: serde_json::Value::Null,
        },
        id: None,
    };
    let child = stack.start_step(&child_of("child")).await?;
    let beat = worker.report(Report::Heartbeat).await?;
    ensure!(!beat.stop, "a heartbeat on a running step: {beat:?}");
    let second = stack.start_step(&child_of("second-child")).await?;
    worker.report(done("parent done")).await?;
    // The worker is answered once its end is stored; the record is written beside that.
    let record = stack
        .wait_exec(&parent.id, Duration::from_secs(10), |r| {
            r.status.is_terminal()
        })
        .await?;
    ensure!(
        record.status.name() == "completed",
        "the report ended it: {:?}",
        record.status
    );
    ensure!(
        record.children == vec![child.id.clone(), second.id.clone()],
        "the children appended after the heartbeats are kept: {:?}",
        record.children
    );
    let first = crate::stack::wait_deliveries(stack, &s, 1, Duration::from_secs(20)).await?;
    ensure!(
        listed_steps(&first[0].text) == vec![parent.id.to_string()],
        "{}",
        first[0].text
    );

    // A cancellation recorded after the heartbeat: the worker's `completed` changes nothing.
    let (s, step) = idle_with_a_step(stack, "unread-cancel", "unread-cancel").await?;
    let worker = ExternalWorker::take(stack, "unread-cancel").await?;
    worker
        .report(Report::Started {
            worker: "w1".into(),
        })
        .await?;
    worker.report(Report::Heartbeat).await?;
    let cancelled: Cancelled = turnstile_shared::api::call(
        &stack.client,
        &Principal::Operator.exec(subj::CANCEL),
        &ExecRef {
            id: step.id.clone(),
        },
        crate::stack::API,
    )
    .await?;
    ensure!(
        cancelled.cancelled.contains(&step.id),
        "{:?}",
        cancelled.cancelled
    );
    stack
        .wait_exec(&step.id, Duration::from_secs(10), |r| {
            r.status.name() == "cancelled"
        })
        .await?;
    let beat = worker.report(Report::Heartbeat).await?;
    ensure!(
        beat.stop,
        "the heartbeat tells the worker to stop: {beat:?}"
    );
    let _ = worker.report(done("finished anyway")).await;
    crate::stack::wait_deliveries(stack, &s, 1, Duration::from_secs(20)).await?;
    let record = stack.exec(&step.id).await?.context("the step's record")?;
    ensure!(
        record.status.name() == "cancelled",
        "the first end wins: {:?}",
        record.status
    );
    // Time for a wrongly routed `completed` to arm a second delivery: the ended queue drained.
    stack.wait_ended_drained().await?;
    stack.wait_idle(&s).await?;
    let deliveries = stack.delivery_turns(&s).await?;
    ensure!(deliveries.len() == 1, "one delivery: {deliveries:?}");
    let text = &deliveries[0].text;
    ensure!(
        listed_steps(text) == vec![step.id.to_string()] && text.contains("[cancelled]"),
        "its owner is told once, cancelled: {text}"
    );
    ensure!(!text.contains("finished anyway"), "{text}");
    Ok(())
}

/// A lane that handed a completion over keeps a pull out for the session's next ones (its
/// standby): a completion stored meanwhile is pushed to that replica. What the standby holds
/// when the replica stops is given back with its lanes, so the next replica hands it over at
/// once, not after the ack wait (60 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_held_by_a_stopping_lanes_standby_is_handed_over_at_once() -> Result<()> {
    let mut stack =
        Stack::start_with(&["a"], &["h1"], &[("TURNSTILE_LANE_ACK_WAIT", "60s")]).await?;
    let r = standby_given_back(&mut stack).await;
    report(&stack, r)
}

async fn standby_given_back(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::execution::Scope;
    use turnstile_shared::step_api::{StartStep, StepKind};
    use turnstile_shared::{arming, subjects};
    let s = stack.create_session("standby", None).await?;
    let holder = stack.send(&s, "hold the lane\n!sleep 2s").await?;
    stack.wait_running(&holder).await?;
    let mut steps = Vec::new();
    for name in ["first", "second"] {
        let step = stack
            .start_step(&StartStep {
                caller: stack.caller(&s).await?,
                name: name.into(),
                scope: Scope::Session,
                work: StepKind::External {
                    queue: "nobody".into(),
                    input: serde_json::Value::Null,
                },
                id: None,
            })
            .await?;
        steps.push(step.id);
    }
    stack.all_complete(&[holder]).await?;
    stack.wait_idle(&s).await?;
    let js = stack.js_as("notification-broker").await?;
    // The first step's end, routed by hand: its delivery opens the lane's standby.
    let (marker, rev) = claim_by_hand(&js, &s).await?;
    let first = end_by_hand(stack, &steps[0], "first done", chrono::Utc::now()).await?;
    store_by_hand(&js, &s, &first).await?;
    arming::publish_item(&js, &s, &marker, rev, Some(&steps[0])).await?;
    let done = stack
        .wait_turn(&marker.delivery.turn(), Duration::from_secs(20))
        .await?;
    ensure!(
        matches!(done.state, TurnState::Completed { .. }),
        "{:?}",
        done.state
    );
    all_acked(stack, &s).await?;
    // The second ends while a delivery is armed (claimed by hand, its item not out yet): its
    // completion is pushed to the standby, which holds it unacked.
    let (marker, rev) = claim_by_hand(&js, &s).await?;
    let second = end_by_hand(stack, &steps[1], "second done", chrono::Utc::now()).await?;
    store_by_hand(&js, &s, &second).await?;
    let completions = stack.js.get_stream(subjects::COMPLETION_STREAM).await?;
    turnstile_tests::wait_until(
        "the second completion pushed to the lane's standby",
        Duration::from_secs(3),
        || async {
            let info = completions
                .consumer_info(subjects::completion_consumer(&s))
                .await?;
            Ok((info.num_pending == 0 && info.num_ack_pending == 1).then_some(()))
        },
    )
    .await?;
    // The replica stops (SIGTERM); another serves the lane and runs the armed delivery.
    let lane = stack.lanes.get_mut("a").context("lane a")?;
    crate::stack::signal(
        lane.pid().context("lane pid")?,
        rustix::process::Signal::TERM,
    )?;
    lane.wait_exit(Duration::from_secs(20)).await?;
    stack.spawn_lane("b")?;
    stack.wait_serving(true).await?;
    arming::publish_item(&js, &s, &marker, rev, None).await?;
    let done = stack
        .wait_turn(&marker.delivery.turn(), Duration::from_secs(15))
        .await
        .context("the held completion handed over by the next replica within 15 s")?;
    ensure!(
        matches!(done.state, TurnState::Completed { .. }),
        "{:?}",
        done.state
    );
    let carried = carried_by(&done);
    ensure!(carried == vec![steps[1].clone()], "carried {carried:?}");
    all_acked(stack, &s).await
}

/// A lane's standby takes up to the delivery cap (100) of completions, then closes: the one
/// that fills it arrives as it closes. Ended one after another, each of 102 results is handed
/// over by the delivery its end armed, in a turn of its own (R3): none waits out the 2 s a
/// delivery gives its completion and is left to a delivery armed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_ended_one_by_one_past_a_full_standby_each_come_with_their_own_delivery(
) -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = one_by_one(&mut stack).await;
    report(&stack, r)
}

async fn one_by_one(stack: &mut Stack) -> Result<()> {
    use futures::StreamExt;
    use turnstile_shared::envelope::Envelope;
    use turnstile_shared::execution::{Scope, StepResult};
    use turnstile_shared::principal::Principal;
    use turnstile_shared::step_api::{Report, StartStep, StepKind, StepReport, StepWorkItem};
    use turnstile_shared::subjects::api as subj;
    use turnstile_shared::topology::{self, TopologyConfig};
    const STEPS: usize = 102;
    let s = stack.create_session("one-by-one", None).await?;
    let holder = stack.send(&s, "start the work\n!sleep 3s").await?;
    stack.wait_running(&holder).await?;
    for i in 0..STEPS {
        stack
            .start_step(&StartStep {
                caller: stack.caller(&s).await?,
                name: format!("step-{i}"),
                scope: Scope::Session,
                work: StepKind::External {
                    queue: "one-by-one".into(),
                    input: serde_json::Value::Null,
                },
                id: None,
            })
            .await?;
    }
    // Taken as an external worker takes it.
    let report = |item: &StepWorkItem, report: Report| {
        let req = StepReport {
            step: item.step.clone(),
            token: item.token.clone(),
            report,
        };
        let subject = Principal::Step(item.step.clone()).steps(subj::REPORT);
        let client = stack.client.clone();
        async move {
            let _: turnstile_shared::step_api::ReportAck =
                turnstile_shared::api::call(&client, &subject, &req, crate::stack::API).await?;
            anyhow::Ok(())
        }
    };
    let consumer = topology::ensure_step_external_consumer(
        &stack.js,
        &TopologyConfig::default(),
        "one-by-one",
    )
    .await?;
    let mut messages = consumer.messages().await?;
    let mut work = Vec::with_capacity(STEPS);
    while work.len() < STEPS {
        let msg = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .context("step work")?
            .context("work stream ended")??;
        let item: StepWorkItem = Envelope::decode(&msg.payload)?.data_as()?;
        report(&item, Report::Started { worker: "w".into() }).await?;
        msg.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        work.push(item);
    }
    stack.all_complete(&[holder]).await?;
    stack.wait_idle(&s).await?;
    // Each result's delivery turn ends before the next result: its turn's end event, as it
    // comes (the standby is out 5 s, so the rounds are waited for by events, not polls).
    let mut ended = stack
        .client
        .subscribe(turnstile_shared::subjects::session_events(&s))
        .await?;
    for (i, item) in work.iter().enumerate() {
        let result = StepResult {
            exit_code: Some(0),
            summary: "done".into(),
            output: vec![],
        };
        report(item, Report::Completed { result }).await?;
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(20), ended.next())
                .await
                .with_context(|| format!("the delivery of result {}", i + 1))?
                .context("event subscription ended")?;
            let env = Envelope::decode(&msg.payload)?;
            if env.kind == "delivery.completed" {
                break;
            }
        }
    }
    let delivered = stack.delivery_turns(&s).await?;
    ensure!(
        delivered.len() == STEPS,
        "{} delivery turns",
        delivered.len()
    );
    for d in &delivered {
        ensure!(
            carried_by(d).len() == 1,
            "{} carried {:?}",
            d.id,
            carried_by(d)
        );
    }
    let armed = stack
        .events()
        .await?
        .iter()
        .filter(|e| e.kind == "delivery.queued" && e.session.as_ref() == Some(&s))
        .count();
    ensure!(
        armed == STEPS,
        "{armed} deliveries armed for {STEPS} results (one gave up on its result and another \
         was armed for it)"
    );
    all_acked(stack, &s).await
}
