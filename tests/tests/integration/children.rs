//! The exact tree (R6), cancellation by ownership (R7) and delivery only to the owner (R8).

use std::time::Duration;
use turnstile_shared::api::ErrorCode;

use anyhow::{ensure, Context, Result};
use turnstile_shared::execution::{ExecKind, Scope};
use turnstile_shared::records::TurnState;
use turnstile_shared::step_api::{Caller, StartStep, StepKind};
use turnstile_shared::{ExecutionId, StepId};
use turnstile_tests::{bin_path, ServiceProcess};

use crate::stack::{listed_steps, report, wait_deliveries, wait_until_tree, Stack};

/// R6: a step started by a step, and an `external` step reported by a
/// separate worker process, sit under the turn that started the chain; the turn's tree is not
/// settled until they are, though the turn itself has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_of_steps_and_external_work_stay_under_their_turn() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = exact_tree(&mut stack).await;
    report(&stack, r)
}

async fn exact_tree(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("plat-100", None).await?;
    let turn = stack.send(&s, "launch the pipeline\n!sleep 3s").await?;
    stack.wait_running(&turn).await?;
    // The agent's tool calls, made with the session's own credentials.
    let caller = stack.caller(&s).await?;
    let cli = bin_path("turnstile")?.to_string_lossy().into_owned();
    let parent = stack
        .start_step(&StartStep {
            caller: caller.clone(),
            name: "orchestrator".into(),
            scope: Scope::Session,
            work: StepKind::Command {
                argv: vec![
                    "sh".into(),
                    "-c".into(),
                    format!(
                        "{cli} step start --name grandchild --scope run -- sleep 4 && sleep 0.5"
                    ),
                ],
            },
            id: None,
        })
        .await?;
    let external = stack
        .start_step(&StartStep {
            caller,
            name: "review".into(),
            scope: Scope::Session,
            work: StepKind::External {
                queue: "review".into(),
                input: serde_json::json!({"pr": 7}),
            },
            id: None,
        })
        .await?;
    // An external worker runs on an operator's identity (it takes work off the queue).
    let env = vec![("TURNSTILE_NATS_URL".to_string(), stack.operator_url())];
    let mut worker = ServiceProcess::spawn_in(
        stack.dir.path(),
        "turnstile",
        &[
            "step",
            "work",
            "--queue",
            "review",
            "--once",
            "--",
            "sh",
            "-c",
            "sleep 2; echo reviewed $TURNSTILE_STEP_INPUT",
        ]
        .map(String::from),
        &env,
        "worker-review",
    )?;
    let turn_x = ExecutionId::from(&turn);
    // The turn ends first; its tree stays open while the chain runs.
    let ended = stack.wait_turn(&turn, Duration::from_secs(20)).await?;
    ensure!(
        matches!(ended.state, TurnState::Completed { .. }),
        "{:?}",
        ended.state
    );
    let open = wait_until_tree(stack, &turn_x, Duration::from_secs(20), |t| {
        t.record.status.is_terminal()
            && t.nodes
                .iter()
                .any(|n| n.record.id == parent.id && n.nodes.len() == 1)
    })
    .await?;
    ensure!(
        !open.settled,
        "the turn's tree is not settled while its chain runs"
    );
    let orchestrator = open
        .nodes
        .iter()
        .find(|n| n.record.id == parent.id)
        .context("orchestrator under the turn")?;
    let grandchild = &orchestrator.nodes[0].record;
    ensure!(
        grandchild.parent.as_ref() == Some(&parent.id),
        "grandchild's parent is the step that started it"
    );
    ensure!(
        grandchild.owner.as_ref() == Some(&s),
        "it belongs to the same session"
    );
    ensure!(
        open.nodes
            .iter()
            .any(|n| n.record.id == external.id && n.record.parent.as_ref() == Some(&turn_x)),
        "the external step sits under the turn"
    );
    // Everything ends; only then is the tree settled.
    let settled = wait_until_tree(stack, &turn_x, Duration::from_secs(30), |t| t.settled).await?;
    let review = settled
        .nodes
        .iter()
        .find(|n| n.record.id == external.id)
        .context("review")?;
    ensure!(
        review.record.status.name() == "completed",
        "{:?}",
        review.record.status
    );
    ensure!(
        review.record.status.summary().contains("reviewed"),
        "{}",
        review.record.status.summary()
    );
    ensure!(
        worker.wait_exit(Duration::from_secs(10)).await?.success(),
        "the worker exits after one step"
    );
    ensure!(
        settled
            .nodes
            .iter()
            .all(|n| n.record.kind == ExecKind::Step),
        "no delivery is a child of the turn"
    );
    // The three results come back to the session.
    let d = wait_deliveries(stack, &s, 1, Duration::from_secs(30)).await?;
    let listed: usize = stack
        .delivery_turns(&s)
        .await?
        .iter()
        .map(|r| listed_steps(&r.text).len())
        .sum();
    ensure!(
        !d.is_empty() && listed == 3,
        "three results delivered, got {listed}"
    );
    Ok(())
}

/// R7, R8: the terminal dies mid-turn. Its `turn`-scoped step is cancelled
/// and its process stopped; its `detached` step runs on, and its completion reaches the
/// session (the watcher) once the session runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dying_terminal_cancels_its_turns_work_but_not_what_it_watches() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = terminal_dies(&mut stack).await;
    report(&stack, r)
}

async fn terminal_dies(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("plat-171", None).await?;
    let turn = stack
        .send(
            &s,
            "!step own-work 41.5s --scope turn\n!step watched-run 6s --scope detached\n!sleep 60s",
        )
        .await?;
    let turn_x = ExecutionId::from(&turn);
    let tree = wait_until_tree(stack, &turn_x, Duration::from_secs(20), |t| {
        t.nodes.len() == 2 && t.nodes.iter().all(|n| n.record.status.name() == "running")
    })
    .await?;
    let find = |name: &str| {
        tree.nodes
            .iter()
            .find(|n| n.record.name == name)
            .map(|n| n.record.clone())
            .with_context(|| format!("step {name}"))
    };
    let own = find("own-work")?;
    let watched = find("watched-run")?;
    ensure!(
        watched.owner.is_none() && watched.watchers == vec![s.clone()],
        "detached: watched, not owned"
    );
    ensure!(
        process_running("sleep 41.5"),
        "the turn-scoped step's process runs"
    );

    // Kill the agent process in its pane.
    let sock = stack.dir.path().join("host-h1").join("tmux.sock");
    let out = std::process::Command::new("tmux")
        .arg("-S")
        .arg(&sock)
        .args(["list-panes", "-t", s.as_str(), "-F", "#{pane_pid}"])
        .output()?;
    let pid = String::from_utf8_lossy(&out.stdout).trim().to_string();
    ensure!(!pid.is_empty(), "agent pane pid");
    eprintln!("killing agent pane pid {pid:?}");
    let pid: u32 = pid.parse()?;
    ensure!(pid > 1, "agent pane pid {pid}");
    crate::stack::signal(pid, rustix::process::Signal::KILL)?;

    let failed = stack.wait_turn(&turn, Duration::from_secs(20)).await?;
    ensure!(
        matches!(failed.state, TurnState::Failed { .. }),
        "{:?}",
        failed.state
    );
    let own = stack
        .wait_exec(&own.id, Duration::from_secs(15), |r| r.status.is_terminal())
        .await?;
    ensure!(
        own.status.name() == "cancelled",
        "turn-scoped work is cancelled: {:?}",
        own.status
    );
    turnstile_tests::wait_until(
        "the cancelled step's process to stop",
        Duration::from_secs(10),
        || async { Ok((!process_running("sleep 41.5")).then_some(())) },
    )
    .await?;
    ensure!(
        stack
            .exec(&watched.id)
            .await?
            .context("watched")?
            .status
            .name()
            == "running",
        "the detached step is untouched by its launcher's death"
    );
    let watched = stack
        .wait_exec(&watched.id, Duration::from_secs(20), |r| {
            r.status.is_terminal()
        })
        .await?;
    ensure!(watched.status.name() == "completed", "{:?}", watched.status);
    // A delivery relaunches the agent (same conversation) and hands the results over: the
    // cancelled step's to its owner, the detached one's to its watcher.
    let d = wait_deliveries(stack, &s, 1, Duration::from_secs(40)).await?;
    ensure!(
        matches!(d[0].state, TurnState::Completed { .. }),
        "{:?}",
        d[0].state
    );
    let watched_id = watched.id.to_string();
    turnstile_tests::wait_until(
        "the watched result delivered",
        Duration::from_secs(40),
        || async {
            let t = stack.transcript(&s).await?;
            Ok(t.iter()
                .any(|m| listed_steps(m).contains(&watched_id))
                .then_some(()))
        },
    )
    .await?;
    let last = stack.send(&s, "still there?").await?;
    stack.all_complete(&[last]).await?;
    let transcript = stack.transcript(&s).await?;
    ensure!(
        transcript[0].contains("!step own-work"),
        "one conversation: {transcript:?}"
    );
    let handed: Vec<String> = transcript.iter().flat_map(|m| listed_steps(m)).collect();
    ensure!(
        handed
            .iter()
            .filter(|h| **h == watched.id.to_string())
            .count()
            == 1,
        "the watched completion reached the session once: {handed:?}"
    );
    Ok(())
}

fn process_running(pattern: &str) -> bool {
    std::process::Command::new("pgrep")
        .args(["-f", pattern])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// R8, R15: a completion addressed to another session, a step started with another
/// session's token, and a forged token are each refused with a clear error and recorded;
/// nothing is delivered. A start repeated by its own session after its turn ended gets its
/// step back (R14); the same step id from another session is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_completions_and_tokens_are_refused_and_recorded() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = refusals(&mut stack).await;
    report(&stack, r)
}

async fn refusals(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::delivery::Completion;
    let a = stack.create_session("owner", None).await?;
    let b = stack.create_session("bystander", None).await?;
    let turn = stack.send(&a, "!step mine 200ms\n!sleep 2s").await?;
    let turn_x = ExecutionId::from(&turn);
    let tree = wait_until_tree(stack, &turn_x, Duration::from_secs(20), |t| {
        t.nodes.len() == 1
    })
    .await?;
    let mine = tree.nodes[0].record.clone();
    stack.wait_turn(&turn, Duration::from_secs(20)).await?;

    // A session's token does not act for another session, and a forged one acts for nobody.
    let b_token = stack.session_record(&b).await?.token;
    let start = |caller: Caller| StartStep {
        caller,
        name: "intruder".into(),
        scope: Scope::Turn,
        work: StepKind::Command {
            argv: vec!["true".into()],
        },
        id: Some(StepId::new()),
    };
    let err = stack
        .start_step(&start(Caller {
            session: Some(a.clone()),
            step: None,
            token: b_token,
        }))
        .await
        .expect_err("another session's token");
    ensure!(
        err.code == ErrorCode::Unauthorized && err.message.contains("wrong token"),
        "{err}"
    );
    let err = stack
        .start_step(&start(Caller {
            session: Some(a.clone()),
            step: None,
            token: "tok_forged".into(),
        }))
        .await
        .expect_err("forged token");
    ensure!(err.code == ErrorCode::Unauthorized, "{err}");
    let err = stack
        .start_step(&start(Caller {
            session: None,
            step: Some(StepId::new()),
            token: "x".into(),
        }))
        .await
        .expect_err("unknown step");
    ensure!(err.code == ErrorCode::Unauthorized, "{err}");
    // A session holding no turn cannot start steps (R6).
    let err = stack
        .start_step(&start(stack.caller(&b).await?))
        .await
        .expect_err("no turn");
    ensure!(err.code == ErrorCode::NoTurn, "{err}");

    // A completion of A's step addressed to B, published straight onto B's queue.
    let forged = Completion::of(&stack.exec(&mine.id).await?.context("mine")?);
    let env = forged.envelope(&b)?.with_id("forged-completion");
    turnstile_shared::events::publish_durable(
        &stack.js_as("notification-broker").await?,
        turnstile_shared::subjects::completion(&b, &mine.id),
        &env,
        None,
    )
    .await?;
    // B's own step completes: its delivery takes both, refuses the forged one, hands over
    // only B's.
    let tb = stack.send(&b, "!step legit 200ms\n!sleep 1s").await?;
    stack.all_complete(std::slice::from_ref(&tb)).await?;
    let legit = stack.tree(&ExecutionId::from(&tb)).await?.nodes[0]
        .record
        .id
        .clone();
    let rejected = stack
        .wait_events("completion.rejected", Duration::from_secs(20), |ev| {
            ev.iter()
                .find(|e| e.kind == "completion.rejected" && e.session.as_ref() == Some(&b))
                .cloned()
        })
        .await?;
    ensure!(
        rejected.data["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("neither owns nor watches"),
        "{:?}",
        rejected.data
    );
    let refused = stack.events().await?;
    let auth: Vec<_> = refused
        .iter()
        .filter(|e| e.kind == "auth.refused")
        .collect();
    ensure!(
        auth.len() >= 3,
        "each refused call is recorded: {}",
        auth.len()
    );
    ensure!(
        auth.iter().all(|e| !e.data.to_string().contains("tok_")),
        "no token is recorded"
    );
    // B's agent got its own message and its own result only; A got its own result.
    let db = wait_deliveries(stack, &b, 1, Duration::from_secs(20)).await?;
    ensure!(
        listed_steps(&db[0].text) == vec![legit.to_string()],
        "{}",
        db[0].text
    );
    let tb_transcript = stack.transcript(&b).await?;
    ensure!(tb_transcript.len() == 2, "{tb_transcript:?}");
    let da = wait_deliveries(stack, &a, 1, Duration::from_secs(20)).await?;
    ensure!(listed_steps(&da[0].text) == vec![mine.id.to_string()]);
    stack.wait_idle(&a).await?;
    // A start repeated after its turn ended, A's lane idle (its first answer lost: the compose
    // suite's partition stage saw an agent's retry refused `no_turn`) gets its step back; the same
    // id from another session is refused as registered elsewhere (R8).
    let again = |caller: Caller| StartStep {
        caller,
        name: mine.name.clone(),
        scope: mine.scope,
        work: StepKind::Command {
            argv: vec!["true".into()],
        },
        id: mine.id.as_step(),
    };
    let back = stack
        .start_step(&again(stack.caller(&a).await?))
        .await
        .map_err(|e| anyhow::anyhow!("a repeated start after its turn ended: {e}"))?;
    ensure!(back.id == mine.id, "{back:?}");
    let err = stack
        .start_step(&again(stack.caller(&b).await?))
        .await
        .expect_err("another session's start of the same step");
    ensure!(err.code == ErrorCode::ForeignExecution, "{err}");
    Ok(())
}
