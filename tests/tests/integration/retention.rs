//! Bounded state: a finished record (a run that ended, a stopped session) is removed its
//! retention after its last write, while a live one stays however long it goes unwritten; and
//! lists return pages, newest first, that chain by their cursor.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use chrono::Utc;
use turnstile_shared::api::{self, ErrorCode, SessionRef};
use turnstile_shared::page::{Page, PageRequest};
use turnstile_shared::records::SessionRecord;
use turnstile_shared::runs::{RunRecord, RunState};
use turnstile_shared::schedules::ListRuns;
use turnstile_shared::subjects::{self, api as subj};
use turnstile_tests::{bin_path, wait_until};

use crate::stack::{report, Stack, API};

/// The retention the test provisions with.
const RETENTION: Duration = Duration::from_secs(3);

#[tokio::test]
async fn finished_records_leave_after_their_retention_and_live_ones_stay() -> Result<()> {
    let mut stack =
        Stack::start_with(&["a"], &["h1"], &[("TURNSTILE_RECORD_RETENTION", "3s")]).await?;
    let r = retention(&mut stack).await;
    report(&stack, r)
}

async fn retention(stack: &mut Stack) -> Result<()> {
    let runs = stack.js.get_key_value(subjects::RUNS_BUCKET).await?;
    let sessions = stack.js.get_key_value(subjects::SESSIONS_BUCKET).await?;
    let s = stack.create_session("kept", None).await?;
    let done = stack.start_run(&s, &["a quick one"], None).await?;
    let done = stack.wait_run(&done.id, Duration::from_secs(60)).await?;
    let RunState::Completed { ended_at, .. } = done.state else {
        anyhow::bail!("the quick run did not complete: {:?}", done.state);
    };
    // A run still going: its one turn outlasts the retention several times, unwritten.
    let live = stack.start_run(&s, &["!sleep 15s"], None).await?;
    let live = stack
        .wait_run_state(&live.id, Duration::from_secs(30), |r| {
            matches!(r.state, RunState::Running { .. })
        })
        .await?;
    let RunState::Running { started_at } = live.state else {
        anyhow::bail!("not running: {:?}", live.state);
    };
    let stopped = stack.create_session("stopped", None).await?;
    let _: SessionRecord = api::call(
        &stack.client,
        subj::SESSION_STOP,
        &SessionRef {
            session: stopped.clone(),
        },
        API,
    )
    .await?;

    // The finished run goes, not before its retention...
    wait_until(
        "the finished run to be removed",
        Duration::from_secs(30),
        || {
            let runs = runs.clone();
            let id = done.id.clone();
            async move { Ok(runs.get(id.as_str()).await?.is_none().then_some(())) }
        },
    )
    .await?;
    let age = (Utc::now() - ended_at).to_std().unwrap_or_default();
    ensure!(
        age >= RETENTION,
        "removed {age:?} after it ended, before the retention"
    );
    // ... and so does the stopped session.
    wait_until(
        "the stopped session to be removed",
        Duration::from_secs(30),
        || {
            let sessions = sessions.clone();
            let id = stopped.clone();
            async move { Ok(sessions.get(id.as_str()).await?.is_none().then_some(())) }
        },
    )
    .await?;

    // The live run has gone unwritten for more than two retentions, and stays.
    let unwritten = RETENTION * 2 + Duration::from_secs(1);
    let until = started_at + chrono::TimeDelta::from_std(unwritten)?;
    if let Ok(left) = (until - Utc::now()).to_std() {
        tokio::time::sleep(left).await;
    }
    let still: RunRecord = runs
        .get(live.id.as_str())
        .await?
        .map(|b| serde_json::from_slice(&b))
        .transpose()?
        .context("the live run's record was removed")?;
    ensure!(
        matches!(still.state, RunState::Running { .. }),
        "{:?}",
        still.state
    );
    let session = stack.session_record(&s).await?;
    ensure!(session.is_active(), "the live session: {:?}", session.state);
    // And it finishes normally afterwards.
    stack.wait_run(&live.id, Duration::from_secs(60)).await?;
    Ok(())
}

#[tokio::test]
async fn a_lane_keeps_its_items_until_done_then_removes_them() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = lane_items(&mut stack).await;
    report(&stack, r)
}

async fn lane_items(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("kept-items", None).await?;
    let slow = stack.send(&s, "!sleep 2s\n!reply slow").await?;
    let queued = stack.send(&s, "!reply queued").await?;
    stack.wait_running(&slow).await?;
    // One item in flight and one queued: both stored, however long they wait.
    let held = stack.lane_items(&s).await?;
    ensure!(held.len() == 2, "items stored while one runs: {held:?}");
    let view = stack.show(&s).await?;
    ensure!(view.busy && view.queued == 1, "{view:?}");
    stack.all_complete(&[slow, queued]).await?;
    // Done with, each is removed: the stream keeps nothing of an idle lane.
    stack.wait_lane_emptied(&s).await?;
    let view = stack.wait_idle(&s).await?;
    ensure!(!view.busy && view.queued == 0, "{view:?}");
    Ok(())
}

#[tokio::test]
async fn lists_come_in_pages_newest_first_that_chain_by_cursor() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = pages(&mut stack).await;
    report(&stack, r)
}

async fn pages(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("paged", None).await?;
    // One after the other, so their last writes (their ends) come in this order.
    let mut ended = Vec::new();
    for i in 0..7 {
        let run = stack.start_run(&s, &[&format!("run {i}")], None).await?;
        ended.push(stack.wait_run(&run.id, Duration::from_secs(60)).await?.id);
    }
    let list = |after: Option<String>, limit: u32| {
        let req = ListRuns {
            schedule: None,
            page: PageRequest {
                limit: Some(limit),
                after,
            },
        };
        let client = stack.client.clone();
        async move {
            let page: Page<RunRecord> = api::call(&client, subj::RUNS_LIST, &req, API).await?;
            anyhow::Ok(page)
        }
    };
    let mut seen = Vec::new();
    let mut after = None;
    let mut pages = 0;
    loop {
        let page = list(after.clone(), 3).await?;
        pages += 1;
        ensure!(page.items.len() <= 3, "a page of {}", page.items.len());
        seen.extend(page.items.iter().map(|r| r.id.clone()));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
        ensure!(pages < 10, "the pages never end: {seen:?}");
    }
    ensure!(pages >= 3, "7 runs in pages of 3 took {pages} page(s)");
    let unique: HashSet<_> = seen.iter().collect();
    ensure!(unique.len() == seen.len(), "a run on two pages: {seen:?}");
    let newest_first: Vec<_> = ended.iter().rev().cloned().collect();
    ensure!(seen == newest_first, "pages {seen:?}, runs ended {ended:?}");

    // Bad paging input is refused clearly.
    for (after, limit, what) in [(Some("x1".to_string()), 3, "cursor"), (None, 0, "limit")] {
        let e = list(after, limit).await.err().context("accepted")?;
        let e = e.downcast::<api::ApiError>()?;
        ensure!(e.code == ErrorCode::BadRequest, "{e}");
        ensure!(e.message.contains(what), "{e}");
    }

    // The CLI pages the same way: `--limit`, `--json` gives the page with its cursor.
    let cli = bin_path("turnstile")?;
    let run_list = |args: Vec<String>| {
        let mut cmd = tokio::process::Command::new(&cli);
        cmd.args(["run", "list", "--json"]).args(args);
        cmd.envs(stack.env_as("cli"));
        async move {
            let out = cmd.output().await?;
            ensure!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            anyhow::Ok(serde_json::from_slice::<Page<RunRecord>>(&out.stdout)?)
        }
    };
    let first = run_list(vec!["--limit".into(), "4".into()]).await?;
    let rest = run_list(vec![
        "--limit".into(),
        "4".into(),
        "--after".into(),
        first.next.clone().context("no cursor after 4 of 7")?,
    ])
    .await?;
    let ids: Vec<_> = first
        .items
        .iter()
        .chain(&rest.items)
        .map(|r| r.id.clone())
        .collect();
    ensure!(ids == newest_first, "{ids:?}");
    Ok(())
}
