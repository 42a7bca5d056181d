//! R7 at its edges: work started while its parent ends, by a turn's agent, by a step, or by
//! a start whose broker replica died half-way, is refused or cancelled with the parent, never
//! left queued under it (where a scheduled run holding the lane would wait on it, and the
//! session's turns behind it).

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::api::ErrorCode;
use turnstile_shared::execution::Scope;
use turnstile_shared::step_api::{Caller, StartStep, StepKind};
use turnstile_shared::{ExecutionId, StepId};

use crate::stack::{report, Stack};

/// R7 at the edge: steps started as their turn ends (several callers starting `turn`-scoped
/// steps back to back until they are refused) are either refused `no_turn` or cancelled with
/// the turn; none is left queued under an ended turn (where a scheduled run holding the lane
/// would wait on it, and the session's turns behind it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_started_as_their_turn_ends_never_outlive_it() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = started_at_the_end(&mut stack).await;
    report(&stack, r)
}

async fn started_at_the_end(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::execution::exec_reason;
    let s = stack.create_session("edge", None).await?;
    let caller = stack.caller(&s).await?;
    let mut accepted = Vec::new();
    for round in 0..4 {
        let turn = stack
            .send(&s, &format!("round {round}\n!sleep 300ms"))
            .await?;
        stack.wait_running(&turn).await?;
        let starters = (0..4).map(|k| {
            let caller = caller.clone();
            let shared: &Stack = stack;
            async move {
                let mut mine = Vec::new();
                let until = tokio::time::Instant::now() + Duration::from_secs(5);
                for i in 0.. {
                    let req = StartStep {
                        caller: caller.clone(),
                        name: format!("edge-{round}-{k}-{i}"),
                        scope: Scope::Turn,
                        // Nobody works this queue: only a cancel ends these steps.
                        work: StepKind::External {
                            queue: "nobody".into(),
                            input: serde_json::Value::Null,
                        },
                        id: None,
                    };
                    match shared.start_step(&req).await {
                        Ok(r) => mine.push(r.id),
                        Err(e) if e.code == ErrorCode::NoTurn => break,
                        Err(e) => anyhow::bail!("start {}: {e}", req.name),
                    }
                    if tokio::time::Instant::now() > until {
                        break;
                    }
                }
                Ok::<_, anyhow::Error>(mine)
            }
        });
        for mine in futures::future::join_all(starters).await {
            accepted.extend(mine?);
        }
        stack.wait_turn(&turn, Duration::from_secs(20)).await?;
    }
    ensure!(!accepted.is_empty(), "no start got in");
    all_cancelled(stack, &accepted, exec_reason::TURN_ENDED).await
}

/// R7 at the edge, for a step's children: children started by a step as it is cancelled are
/// refused `parent_ended` or cancelled `parent_cancelled`, never left queued under it; and
/// `turn`-scoped children of a `session`-scoped step, started before and after the turn that
/// started that step ends, are cancelled `turn_ended` (at birth, for those after), while the
/// `session`-scoped step itself lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_started_as_their_parent_step_ends_never_outlive_it() -> Result<()> {
    let stack = Stack::start(&["a"], &["h1"]).await?;
    let r = started_under_an_ending_step(&stack).await;
    let r = match r {
        Ok(()) => started_under_run_work_after_its_turn(&stack).await,
        e => e,
    };
    report(&stack, r)
}

/// Nobody works this queue: only a cancel ends these steps.
fn unworked(caller: &Caller, name: String, scope: Scope, id: Option<StepId>) -> StartStep {
    StartStep {
        caller: caller.clone(),
        name,
        scope,
        work: StepKind::External {
            queue: "nobody".into(),
            input: serde_json::Value::Null,
        },
        id,
    }
}

/// A step's own credentials, as its process holds them.
async fn step_caller(stack: &Stack, step: &StepId) -> Result<Caller> {
    let rec = stack
        .exec(&ExecutionId::from(step))
        .await?
        .context("the step's record")?;
    Ok(Caller {
        session: None,
        step: Some(step.clone()),
        token: rec.token.context("the step's token")?,
    })
}

/// Waits until every step in `ids` has ended (30 s at most each), then checks that it ended
/// cancelled with `reason`. The records are read, not watched: a watch is a consumer on the
/// bucket's stream, and a thousand steps watched one after another can pass the server's
/// default of 1,000 consumers a stream before the ones already dropped are gone.
async fn all_cancelled(stack: &Stack, ids: &[ExecutionId], reason: &str) -> Result<()> {
    use turnstile_shared::execution::ExecStatus;
    for id in ids {
        let what = format!("step {id} to end (it must not outlive its parent)");
        let rec = turnstile_tests::wait_until(&what, Duration::from_secs(30), || async {
            Ok(stack.exec(id).await?.filter(|r| r.status.is_terminal()))
        })
        .await?;
        ensure!(
            matches!(&rec.status, ExecStatus::Cancelled { reason: r, .. } if r == reason),
            "step {id} ended {:?}, not cancelled {reason}",
            rec.status
        );
    }
    Ok(())
}

async fn started_under_an_ending_step(stack: &Stack) -> Result<()> {
    use turnstile_shared::execution::exec_reason;
    let s = stack.create_session("edge-step", None).await?;
    // The turn outlasts this part: only the cancel ends the parents.
    let turn = stack.send(&s, "hold the lane\n!sleep 120s").await?;
    stack.wait_running(&turn).await?;
    let caller = stack.caller(&s).await?;
    let mut accepted = Vec::new();
    // Forty parents: a child indexed just before its parent's cancel walks the children but
    // recorded only after the walk read it is cancelled by its own start (`cancel_if_abandoned`);
    // that window is narrow (taken in 1 of 3 runs here); the rest is checked every run.
    for round in 0..40 {
        let pid = StepId::new();
        let name = format!("parent-{round}");
        stack
            .start_step(&unworked(&caller, name, Scope::Session, Some(pid.clone())))
            .await
            .map_err(|e| anyhow::anyhow!("start parent-{round}: {e}"))?;
        let parent = step_caller(stack, &pid).await?;
        let parent_x = ExecutionId::from(&pid);
        let starters = (0..4).map(|k| {
            let parent = parent.clone();
            async move {
                let mut mine = Vec::new();
                let until = tokio::time::Instant::now() + Duration::from_secs(10);
                for i in 0.. {
                    let req = unworked(
                        &parent,
                        format!("child-{round}-{k}-{i}"),
                        Scope::Session,
                        None,
                    );
                    match stack.start_step(&req).await {
                        Ok(r) => mine.push(r.id),
                        Err(e) if e.code == ErrorCode::ParentEnded => break,
                        Err(e) => anyhow::bail!("start {}: {e}", req.name),
                    }
                    if tokio::time::Instant::now() > until {
                        anyhow::bail!("starts under a cancelled step were still accepted");
                    }
                }
                Ok::<_, anyhow::Error>(mine)
            }
        });
        // The cancel lands while the starters are at it: once the parent lists children.
        let cancel = async {
            stack
                .wait_exec(&parent_x, Duration::from_secs(20), |r| {
                    r.children.len() >= 3
                })
                .await?;
            stack
                .cancel(&parent_x)
                .await
                .map_err(|e| anyhow::anyhow!("cancel {parent_x}: {e}"))?;
            Ok::<_, anyhow::Error>(())
        };
        let (mines, cancelled) = tokio::join!(futures::future::join_all(starters), cancel);
        cancelled?;
        for mine in mines {
            accepted.extend(mine?);
        }
    }
    ensure!(!accepted.is_empty(), "no start got in");
    all_cancelled(stack, &accepted, exec_reason::PARENT_CANCELLED).await
}

async fn started_under_run_work_after_its_turn(stack: &Stack) -> Result<()> {
    use turnstile_shared::execution::exec_reason;
    let s = stack.create_session("edge-run-step", None).await?;
    let turn = stack.send(&s, "start run work\n!sleep 500ms").await?;
    stack.wait_running(&turn).await?;
    let rid = StepId::new();
    let run_work = "run-work".to_string();
    stack
        .start_step(&unworked(
            &stack.caller(&s).await?,
            run_work,
            Scope::Session,
            Some(rid.clone()),
        ))
        .await
        .map_err(|e| anyhow::anyhow!("start run-work: {e}"))?;
    let parent = step_caller(stack, &rid).await?;
    // `turn`-scoped children of the run-scoped step, back to back, until a few have been
    // started after the turn ended.
    let (mut before, mut after) = (Vec::new(), Vec::new());
    let until = tokio::time::Instant::now() + Duration::from_secs(20);
    for i in 0.. {
        let ended = stack
            .turn(&turn)
            .await?
            .is_some_and(|t| t.state.is_terminal());
        if ended && after.len() >= 5 {
            break;
        }
        ensure!(tokio::time::Instant::now() < until, "the turn never ended");
        let req = unworked(&parent, format!("turn-work-{i}"), Scope::Turn, None);
        let started = stack
            .start_step(&req)
            .await
            .map_err(|e| anyhow::anyhow!("start {}: {e}", req.name))?;
        if ended { &mut after } else { &mut before }.push(started.id);
    }
    ensure!(!before.is_empty(), "no child started while the turn ran");
    all_cancelled(stack, &before, exec_reason::TURN_ENDED).await?;
    all_cancelled(stack, &after, exec_reason::TURN_ENDED).await?;
    // The run-scoped step outlives its turn (R7): only its turn-scoped work went.
    let rec = stack
        .exec(&ExecutionId::from(&rid))
        .await?
        .context("run-work's record")?;
    ensure!(!rec.status.is_terminal(), "run-work ended {:?}", rec.status);
    Ok(())
}

/// What the broker logs when the second look at a walk's unrecorded index entries cancels a
/// step (`registry::LATE_CANCELLED`).
const LATE_CANCELLED: &str = "cancelled a step recorded after the walk passed its entry";

/// R7 when a start is cut off half-way: a broker replica that dies between a step's record and
/// its own check of the parent (`cancel_if_abandoned`) leaves a queued step under a turn whose
/// end's walk met its index entry before the record existed. The walk looks at such entries
/// again a moment later: the step ends cancelled `turn_ended`. The dead start's two writes are
/// made here with the broker's identity, in its order: the index entry while the turn runs,
/// the record after the walk has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_cut_off_before_its_check_is_cancelled_by_the_walk() -> Result<()> {
    let stack = Stack::start(&["a"], &["h1"]).await?;
    let r = cut_off_start(&stack).await;
    report(&stack, r)
}

async fn cut_off_start(stack: &Stack) -> Result<()> {
    use turnstile_shared::execution::StepWork;
    use turnstile_shared::execution::{exec_reason, ExecKind, ExecStatus, ExecutionRecord};
    use turnstile_shared::kv::Change;
    let s = stack.create_session("cut-off", None).await?;
    let turn = stack.send(&s, "start work, then end\n!sleep 3s").await?;
    stack.wait_running(&turn).await?;
    let caller = stack.caller(&s).await?;
    // A step started whole: its cancellation shows that the turn's walk has passed.
    let witness = stack
        .start_step(&unworked(&caller, "witness".into(), Scope::Turn, None))
        .await
        .map_err(|e| anyhow::anyhow!("start witness: {e}"))?
        .id;
    let turn_x = ExecutionId::from(&turn);
    let step = ExecutionId::from(&StepId::new());
    let buckets =
        turnstile_shared::topology::bind(&stack.js_as("notification-broker").await?).await?;
    // The dead start's first write: its entry in the running turn's index.
    let node = buckets
        .executions
        .modify::<ExecutionRecord, _>(turn_x.as_str(), |cur| match cur {
            Some(r) if !r.status.is_terminal() => {
                let mut next = r.clone();
                next.children.push(step.clone());
                Change::Write(next)
            }
            _ => Change::Keep,
        })
        .await?
        .context("the turn's node")?;
    ensure!(
        node.children.contains(&step),
        "the turn ended too soon: {:?}",
        node.status
    );
    // The turn ends; its walk cancels the witness and meets the entry with no record (the
    // entry is read before the witness: the walk takes the index from its end; and even the
    // other way round, the record below comes only after the witness's cancel is recorded).
    // A watch, not a poll: the record must come within the walk's 2 s second look.
    let w = stack
        .wait_exec(&witness, Duration::from_secs(20), |r| {
            r.status.is_terminal()
        })
        .await
        .context("the witness outlived its turn")?;
    ensure!(
        matches!(&w.status, ExecStatus::Cancelled { reason, .. } if reason == exec_reason::TURN_ENDED),
        "the witness ended {:?}",
        w.status
    );
    // The dead start's second write, after the walk passed it: the record, queued, its work
    // never handed out. Nobody else will end it.
    let record = ExecutionRecord {
        id: step.clone(),
        kind: ExecKind::Step,
        name: "cut-off".into(),
        parent: Some(turn_x.clone()),
        scope: Scope::Turn,
        session: s.clone(),
        owner: Some(s.clone()),
        watchers: Vec::new(),
        created_at: chrono::Utc::now(),
        work: Some(StepWork::External {
            queue: "nobody".into(),
            input: serde_json::Value::Null,
        }),
        token: Some(turnstile_shared::ids::new_secret()),
        children: Vec::new(),
        handed_over: Vec::new(),
        status: ExecStatus::Queued,
    };
    buckets
        .executions
        .create(step.as_str(), &record)
        .await?
        .context("the step's record was there already")?;
    all_cancelled(stack, std::slice::from_ref(&step), exec_reason::TURN_ENDED)
        .await
        .context("the cut-off step, queued under its ended turn")?;
    // By the walk's second look (`registry::recheck_unrecorded`), as the broker says.
    ensure!(
        stack.logs().contains(LATE_CANCELLED),
        "no second look cancelled the step"
    );
    Ok(())
}
