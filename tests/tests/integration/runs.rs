//! Runs finish what they start (R5, R12): a run's message is done only when everything its
//! turns started is terminal and handed back, and a turn started nothing new.

use std::time::Duration;

use anyhow::{ensure, Result};
use turnstile_shared::runs::RunState;

use crate::stack::{listed_steps, report, Stack};

/// R5, R12: the agent is asked to work through 12 groups,
/// starting one step per turn and ending the turn. The run drives all 12 (one results turn per
/// group) and completes only when a turn starts nothing: 13 rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_drives_twelve_groups_to_the_end_in_thirteen_rounds() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = twelve_groups(&mut stack).await;
    report(&stack, r)
}

async fn twelve_groups(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("plat-361", None).await?;
    let run = stack
        .start_run(
            &s,
            &["work through the 12 groups, one per turn\n!groups 12 300ms"],
            None,
        )
        .await?;
    let done = stack.wait_run(&run.id, Duration::from_secs(120)).await?;
    ensure!(
        matches!(done.state, RunState::Completed { .. }),
        "run ended {:?}",
        done.state
    );
    ensure!(
        done.rounds() == 13,
        "13 rounds, got {}: {:?}",
        done.rounds(),
        done.progress
    );
    // The agent saw the message and twelve hand-overs, each naming one group, in order.
    let transcript = stack.transcript(&s).await?;
    ensure!(
        transcript.len() == 13,
        "{} messages: {transcript:?}",
        transcript.len()
    );
    let mut handed = Vec::new();
    for m in &transcript[1..] {
        let steps = listed_steps(m);
        ensure!(steps.len() == 1, "one result per hand-over: {m}");
        handed.extend(steps);
        ensure!(
            m.contains(&format!("group-{} [completed]", handed.len())),
            "{m}"
        );
    }
    handed.sort();
    handed.dedup();
    ensure!(handed.len() == 12, "twelve distinct groups handed over");
    // Nothing lingers: the lane lets go of the run's item (it acks a moment after the run's
    // record ends) and no delivery is left to run.
    stack.wait_idle(&s).await?;
    Ok(())
}

/// R5, R7: a run's turn starts a 1 s step without naming a scope and ends at once. The step
/// outlives that turn (`session` scope is the default) and the run completes only after it
/// completed and its result was handed to the agent in a second round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_waits_for_the_step_its_turn_started_without_a_scope() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = unscoped_step(&mut stack).await;
    report(&stack, r)
}

async fn unscoped_step(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::execution::{ExecStatus, Scope};
    use turnstile_shared::ExecutionId;
    let s = stack.create_session("unscoped", None).await?;
    let run = stack.start_run(&s, &["round\n!step g 1s ok"], None).await?;
    let done = stack.wait_run(&run.id, Duration::from_secs(60)).await?;
    let RunState::Completed { ended_at, .. } = done.state else {
        anyhow::bail!("run ended {:?}", done.state);
    };
    ensure!(done.rounds() == 2, "2 rounds: {:?}", done.progress);
    let transcript = stack.transcript(&s).await?;
    ensure!(transcript.len() == 2, "{transcript:?}");
    ensure!(
        transcript[1].contains("g [completed]"),
        "the step's result, handed back: {transcript:?}"
    );
    let tree = crate::stack::wait_until_tree(
        stack,
        &ExecutionId::from(&run.id),
        Duration::from_secs(20),
        |t| t.settled,
    )
    .await?;
    let step = run_step(&tree, "g")
        .map(|n| n.record.clone())
        .ok_or_else(|| anyhow::anyhow!("no step g in the run's tree"))?;
    ensure!(step.scope == Scope::Session, "{:?}", step.scope);
    let ExecStatus::Completed {
        ended_at: step_end, ..
    } = step.status
    else {
        anyhow::bail!("the step did not complete: {:?}", step.status);
    };
    ensure!(step_end <= ended_at, "the run ended before its step");
    Ok(())
}

/// R5: a run waits for the result of the step its turn started even when that result is
/// stored well after the step's end is recorded. The compose suite's partition stage (a node
/// cut off for 20 s) saw a run give up after 10 s with nothing fetched and complete without a
/// step's result, which came later in a turn of its own. Here the completions' store refuses
/// every write for 15 s from before the step ends (its end is recorded at once, its
/// completion only when the store takes it again); the run still hands the result over in
/// its own second round, and no delivery outside the run carries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_waits_for_a_result_its_store_took_late() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = stored_late(&mut stack).await;
    report(&stack, r)
}

async fn stored_late(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::subjects;
    use turnstile_shared::ExecutionId;
    let s = stack.create_session("stored-late", None).await?;
    let run = stack.start_run(&s, &["round\n!step g 3s ok"], None).await?;
    let tree = crate::stack::wait_until_tree(
        stack,
        &ExecutionId::from(&run.id),
        Duration::from_secs(30),
        |t| run_step(t, "g").is_some(),
    )
    .await?;
    let step = run_step(&tree, "g")
        .map(|n| n.record.id.clone())
        .ok_or_else(|| anyhow::anyhow!("no step g in the run's tree"))?;
    // The completions' store takes nothing a completion's size from now on.
    let restore = stack.refuse_writes(subjects::COMPLETION_STREAM).await?;
    let stack = &*stack;
    turnstile_tests::wait_until("the step's end recorded", Duration::from_secs(30), || {
        let step = step.clone();
        async move {
            Ok(stack
                .exec(&step)
                .await?
                .filter(|r| r.status.is_terminal())
                .map(|_| ()))
        }
    })
    .await?;
    // The fault lasts longer than the run's wait for completions once lasted (10 s).
    tokio::time::sleep(Duration::from_secs(15)).await;
    stack.restore_stream(restore).await?;
    let done = stack.wait_run(&run.id, Duration::from_secs(90)).await?;
    ensure!(
        matches!(done.state, RunState::Completed { .. }),
        "run ended {:?}",
        done.state
    );
    ensure!(done.rounds() == 2, "2 rounds: {:?}", done.progress);
    let transcript = stack.transcript(&s).await?;
    ensure!(
        transcript.len() == 2 && transcript[1].contains("g [completed]"),
        "the step's result, handed back in the run's second round: {transcript:?}"
    );
    let runs_own: Vec<_> = done.progress.iter().flat_map(|m| m.turns.iter()).collect();
    let outside: Vec<_> = stack
        .delivery_turns(&s)
        .await?
        .into_iter()
        .filter(|t| !runs_own.contains(&&t.id))
        .collect();
    ensure!(
        outside.is_empty(),
        "no delivery outside the run: {outside:?}"
    );
    Ok(())
}

/// R5, R9: a retried run continues where it failed, with the completions that are pending
/// then. A result handed over meanwhile (the failed run gave it back and a delivery turn
/// carried it) is not waited for: the retry ends at once, without a round for it. Once it
/// waited its whole wait for completions (30 s) for a completion that would never come again
/// (seen as a `lifecycle` run outliving its test's wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_run_does_not_wait_for_a_result_handed_over_meanwhile() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = retried_after_hand_over(&mut stack).await;
    report(&stack, r)
}

async fn retried_after_hand_over(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("retried-after", None).await?;
    // The result goes out in a delivery turn of the session's own.
    let run = failed_and_handed_over(stack, &s).await?;
    stack.retry_run(&run.id).await?;
    // Bounded below the run's 30 s wait for completions: a retry waiting for the result
    // handed over already misses it.
    let done = stack.wait_run(&run.id, Duration::from_secs(20)).await?;
    ensure!(
        matches!(done.state, RunState::Completed { .. }),
        "run ended {:?}",
        done.state
    );
    ensure!(
        done.rounds() == 1,
        "no round for a result handed over already: {:?}",
        done.progress
    );
    let carried: Vec<_> = stack
        .transcript(&s)
        .await?
        .into_iter()
        .filter(|t| t.contains("late [completed]"))
        .collect();
    ensure!(carried.len() == 1, "the result typed once: {carried:?}");
    Ok(())
}

/// R9, R14: a retry whose lane item the store did not take is still a retry: the caller is
/// answered with the run queued again (attempt 1), not an error whose own retry would be
/// refused `not_failed`, and the run runs once the store takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_whose_item_the_store_refused_answers_queued_and_runs() -> Result<()> {
    let mut stack =
        Stack::start_with(&["a"], &["h1"], &[("TURNSTILE_ORPHAN_RUN_AFTER", "1s")]).await?;
    let r = retry_item_refused(&mut stack).await;
    report(&stack, r)
}

async fn retry_item_refused(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::subjects;
    let s = stack.create_session("retry-refused", None).await?;
    let run = failed_and_handed_over(stack, &s).await?;
    let restore = stack.refuse_writes(subjects::LANE_STREAM).await?;
    let answered = stack.retry_run(&run.id).await;
    stack.restore_stream(restore).await?;
    let answered = answered.map_err(|e| anyhow::anyhow!("the retry was answered {e}"))?;
    ensure!(
        matches!(answered.state, RunState::Queued) && answered.attempt == 1,
        "answered {:?}, attempt {}",
        answered.state,
        answered.attempt
    );
    let done = stack.wait_run(&run.id, Duration::from_secs(60)).await?;
    ensure!(
        matches!(done.state, RunState::Completed { .. }) && done.attempt == 1,
        "run ended {:?} (attempt {})",
        done.state,
        done.attempt
    );
    Ok(())
}

/// A run failed `max_rounds` (one round allowed; its step's result needs a second) whose result
/// a delivery turn of the session's own carried afterwards.
async fn failed_and_handed_over(
    stack: &Stack,
    s: &turnstile_shared::SessionId,
) -> Result<turnstile_shared::runs::RunRecord> {
    use turnstile_shared::runs::RunLimits;
    use turnstile_shared::ExecutionId;
    let limits = RunLimits {
        max_rounds: 1,
        ..RunLimits::default()
    };
    let run = stack
        .start_run_with(
            s,
            &["!step late 300ms --scope run\n!sleep 100ms"],
            None,
            limits,
        )
        .await?;
    let failed = stack.wait_run(&run.id, Duration::from_secs(60)).await?;
    ensure!(
        matches!(failed.state, RunState::Failed { .. }),
        "{:?}",
        failed.state
    );
    let tree = stack.tree(&ExecutionId::from(&run.id)).await?;
    let step = run_step(&tree, "late")
        .map(|n| n.record.id.clone())
        .ok_or_else(|| anyhow::anyhow!("no step late in the run's tree"))?;
    turnstile_tests::wait_until("the result handed over", Duration::from_secs(30), || {
        let step = step.clone();
        async move {
            Ok(stack
                .exec(&step)
                .await?
                .filter(|r| r.handed_to(s).is_some())
                .map(|_| ()))
        }
    })
    .await?;
    Ok(failed)
}

/// R5, R10, R12: the run's bounds end it `failed` with a named reason; step heartbeats count as
/// progress, a step nobody works on does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_bounds_fail_with_named_reasons_and_heartbeats_are_progress() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = bounds(&mut stack).await;
    report(&stack, r)
}

async fn bounds(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::execution::Scope;
    use turnstile_shared::runs::RunLimits;
    use turnstile_shared::step_api::{StartStep, StepKind};

    // max_rounds: five groups need six rounds; three are allowed.
    let s = stack.create_session("bounded", None).await?;
    let limits = RunLimits {
        max_rounds: 3,
        ..Default::default()
    };
    let run = stack
        .start_run_with(&s, &["!groups 5 200ms"], None, limits)
        .await?;
    let done = stack.wait_run(&run.id, Duration::from_secs(60)).await?;
    match &done.state {
        RunState::Failed {
            reason,
            message_index,
            ..
        } => {
            ensure!(reason == "max_rounds", "{reason}");
            ensure!(*message_index == 0);
        }
        other => anyhow::bail!("a run over max_rounds ended {other:?}"),
    }
    ensure!(
        done.rounds() == 3,
        "stopped at the bound: {}",
        done.rounds()
    );

    // max_duration: a run still going past it ends `failed: max_duration` at its next
    // boundary (the turn in flight is not interrupted).
    let limits = RunLimits {
        max_duration: Duration::from_secs(1),
        ..Default::default()
    };
    let run = stack
        .start_run_with(&s, &["!sleep 2s", "never typed"], None, limits)
        .await?;
    let done = stack.wait_run(&run.id, Duration::from_secs(60)).await?;
    match &done.state {
        RunState::Failed { reason, .. } => ensure!(reason == "max_duration", "{reason}"),
        other => anyhow::bail!("a run over max_duration ended {other:?}"),
    }
    ensure!(
        !stack
            .transcript(&s)
            .await?
            .iter()
            .any(|m| m == "never typed"),
        "the run stopped at the bound"
    );

    // A 5 s step with a 2 s idle timeout: its heartbeats keep the run alive.
    let limits = RunLimits {
        idle_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let run = stack
        .start_run_with(&s, &["!step slow 5s --scope run"], None, limits)
        .await?;
    let done = stack.wait_run(&run.id, Duration::from_secs(60)).await?;
    ensure!(
        matches!(done.state, RunState::Completed { .. }),
        "heartbeats are progress: {:?}",
        done.state
    );

    // An external step no worker takes: nothing progresses, the run fails idle_timeout.
    let run = stack
        .start_run_with(&s, &["hold on\n!sleep 2s"], None, limits)
        .await?;
    let first_turn = run.id.turn(0, 0);
    stack.wait_running(&first_turn).await?;
    let step = stack
        .start_step(&StartStep {
            caller: stack.caller(&s).await?,
            name: "orphan".into(),
            scope: Scope::Session,
            work: StepKind::External {
                queue: "nobody-serves-this".into(),
                input: serde_json::Value::Null,
            },
            id: None,
        })
        .await?;
    ensure!(
        step.parent.as_ref().map(|p| p.as_str()) == Some(first_turn.as_str()),
        "a step started during a run's turn is that turn's child (R6)"
    );
    let done = stack.wait_run(&run.id, Duration::from_secs(60)).await?;
    match &done.state {
        RunState::Failed {
            reason, execution, ..
        } => {
            ensure!(reason == "idle_timeout", "{reason}");
            ensure!(execution.as_ref().map(|e| e.as_str()) == Some(first_turn.as_str()));
        }
        other => anyhow::bail!("expected idle_timeout, got {other:?}"),
    }
    // Nothing lingers after a failed run (R13): the work it owned is cancelled, and that
    // cancellation is handed over in one delivery, after which the session is idle.
    let orphan = stack
        .wait_exec(&step.id, Duration::from_secs(20), |r| {
            r.status.is_terminal()
        })
        .await?;
    ensure!(orphan.status.name() == "cancelled", "{:?}", orphan.status);
    turnstile_tests::wait_until(
        "the session to go idle",
        Duration::from_secs(30),
        || async {
            let v = stack.show(&s).await?;
            Ok((!v.busy && v.queued == 0).then_some(()))
        },
    )
    .await?;
    Ok(())
}

/// R14: the session-lane replica is SIGKILLed mid-run; another continues the same run without
/// re-sending a delivered message or re-running a finished step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_survives_its_lane_replica_being_killed() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = lane_killed_mid_run(&mut stack).await;
    report(&stack, r)
}

async fn lane_killed_mid_run(stack: &mut Stack) -> Result<()> {
    use anyhow::Context;
    let s = stack.create_session("resumed", None).await?;
    let run = stack
        .start_run(&s, &["four groups\n!groups 4 1s"], Some("wrap up"))
        .await?;
    // Kill the replica while the run waits for group 2.
    let second = run.id.turn(0, 1);
    stack.wait_running(&second).await?;
    stack.lanes.get_mut("a").context("a")?.kill().await?;
    stack.spawn_lane("a2")?;
    let done = stack.wait_run(&run.id, Duration::from_secs(90)).await?;
    ensure!(
        matches!(done.state, RunState::Completed { .. }),
        "{:?}",
        done.state
    );
    ensure!(
        done.rounds() == 6,
        "5 rounds + the finalizer: {}",
        done.rounds()
    );
    let transcript = stack.transcript(&s).await?;
    ensure!(
        transcript.len() == 6,
        "each message typed once: {transcript:?}"
    );
    let handed: Vec<String> = transcript.iter().flat_map(|m| listed_steps(m)).collect();
    let mut unique = handed.clone();
    unique.sort();
    unique.dedup();
    ensure!(
        handed.len() == 4 && unique.len() == 4,
        "each group handed over once: {handed:?}"
    );
    // No step was run twice (a second attempt would fail it `worker_lost`).
    for id in &unique {
        let exec = stack.exec(&id.parse()?).await?.context("step")?;
        ensure!(exec.status.name() == "completed", "{id}: {:?}", exec.status);
    }
    Ok(())
}

/// R5, background agents: step kind `agent` runs its prompt in a new session on the
/// parent's host as a run (R5), completes with the agent's final reply only after the steps it
/// started are done and handed back to it, and its completion reaches the owner session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_agent_finishes_its_own_work_before_reporting() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = background_agent(&mut stack).await;
    report(&stack, r)
}

async fn background_agent(stack: &mut Stack) -> Result<()> {
    use anyhow::Context;
    use turnstile_shared::execution::{agent_run, agent_session, Scope};
    use turnstile_shared::step_api::{StartStep, StepKind};

    let owner = stack.create_session("owner", None).await?;
    let turn = stack.send(&owner, "delegate the groups\n!sleep 3s").await?;
    stack.wait_running(&turn).await?;
    let step = stack
        .start_step(&StartStep {
            caller: stack.caller(&owner).await?,
            name: "helper".into(),
            scope: Scope::Session,
            work: StepKind::Agent {
                prompt: "two groups in the background\n!groups 2 300ms".into(),
            },
            id: None,
        })
        .await?;
    let step_id = step.id.as_step().context("a step id")?;
    let done = stack
        .wait_exec(&step.id, Duration::from_secs(60), |r| {
            r.status.is_terminal()
        })
        .await?;
    ensure!(done.status.name() == "completed", "{:?}", done.status);
    // The agent's own run did all its work first: its message and two hand-overs.
    let run = agent_run(&step_id).context("run id")?;
    let run = stack.wait_run(&run, Duration::from_secs(10)).await?;
    ensure!(
        matches!(run.state, RunState::Completed { .. }),
        "{:?}",
        run.state
    );
    ensure!(run.rounds() == 3, "agent rounds: {}", run.rounds());
    let agent = agent_session(&step_id).context("session id")?;
    let agent_transcript = stack.transcript(&agent).await?;
    ensure!(agent_transcript.len() == 3, "{agent_transcript:?}");
    ensure!(
        !done.status.summary().is_empty(),
        "the step carries the agent's final reply"
    );
    // The owner session gets the agent's completion, once.
    let deliveries =
        crate::stack::wait_deliveries(stack, &owner, 1, Duration::from_secs(30)).await?;
    let listed: Vec<String> = deliveries
        .iter()
        .flat_map(|d| listed_steps(&d.text))
        .collect();
    ensure!(
        listed.iter().filter(|s| **s == step.id.to_string()).count() == 1,
        "{listed:?}"
    );
    // The agent's session ends with its work (R13).
    turnstile_tests::wait_until(
        "the agent session to stop",
        Duration::from_secs(20),
        || async { Ok((!stack.session_record(&agent).await?.is_active()).then_some(())) },
    )
    .await?;
    Ok(())
}

/// R6: a run is a node of the execution tree: run → messages → turns → steps; it is settled
/// only when its whole tree is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_the_root_of_its_tree() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = run_tree(&mut stack).await;
    report(&stack, r)
}

async fn run_tree(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::execution::ExecKind;
    use turnstile_shared::ExecutionId;
    let s = stack.create_session("treed", None).await?;
    let run = stack
        .start_run(&s, &["!groups 2 200ms", "and a second message"], None)
        .await?;
    stack.wait_run(&run.id, Duration::from_secs(60)).await?;
    let root = ExecutionId::from(&run.id);
    let tree = crate::stack::wait_until_tree(stack, &root, Duration::from_secs(20), |t| {
        t.settled && t.nodes.len() == 2 && t.nodes[0].nodes.len() == 3
    })
    .await?;
    ensure!(tree.record.kind == ExecKind::Run);
    let first = &tree.nodes[0];
    ensure!(
        first.record.kind == ExecKind::Message,
        "{:?}",
        first.record.kind
    );
    // The message's turns: its own, then two hand-overs; its first turn started group-1.
    let steps: Vec<_> = first
        .nodes
        .iter()
        .flat_map(|t| t.nodes.iter())
        .map(|n| n.record.name.clone())
        .collect();
    ensure!(steps == ["group-1", "group-2"], "{steps:?}");
    ensure!(
        tree.nodes[1].nodes.len() == 1,
        "the second message took one turn"
    );
    Ok(())
}

/// The step named `name` that a turn of a run's message started (run, message, turn, step).
fn run_step<'a>(
    run: &'a turnstile_shared::step_api::TreeNode,
    name: &str,
) -> Option<&'a turnstile_shared::step_api::TreeNode> {
    run.nodes
        .iter()
        .flat_map(|m| m.nodes.iter())
        .flat_map(|t| t.nodes.iter())
        .find(|n| n.record.name == name)
}
