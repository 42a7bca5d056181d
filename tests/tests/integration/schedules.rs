//! Schedules fire every slot exactly once with an honest record (R11), and their runs finish
//! what they start (R5).

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::runs::RunState;
use turnstile_shared::schedules::{Overlap, SlotOutcome};

use crate::stack::{listed_steps, report, schedule, Stack};

/// R5, R11: a schedule firing every 20 s whose runs each
/// start several background steps during a long turn. Three consecutive slots all fire, none
/// is skipped, no run hits idle_timeout, and each run hands its results over in one batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_consecutive_slots_fire_and_each_run_hands_over_once() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = three_slots(&mut stack).await;
    report(&stack, r)
}

async fn three_slots(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("social-media", None).await?;
    let message = "daily execution\n!step a 1s --scope run\n!step b 2s --scope run\n!step c 3s --scope run\n!sleep 8s";
    stack
        .add_schedule(&schedule("daily-x3", "*/20 * * * * *", &s, &[message]))
        .await?;
    let slots = stack
        .wait_slots("daily-x3", 3, Duration::from_secs(80))
        .await?;
    let first3 = &slots[..3];
    let mut runs = Vec::new();
    for slot in first3 {
        match &slot.outcome {
            SlotOutcome::Fired { run, late, .. } => {
                ensure!(!late, "slot {} fired late", slot.slot);
                runs.push(run.clone());
            }
            other => anyhow::bail!("slot {} was {other:?}, not fired", slot.slot),
        }
    }
    for pair in first3.windows(2) {
        ensure!(
            (pair[1].slot - pair[0].slot).num_seconds() == 20,
            "consecutive slots"
        );
    }
    for run in &runs {
        let done = stack.wait_run(run, Duration::from_secs(40)).await?;
        ensure!(
            matches!(done.state, RunState::Completed { .. }),
            "run {run}: {:?}",
            done.state
        );
        // The message turn, then ONE hand-over carrying all three results.
        ensure!(done.rounds() == 2, "run {run}: {} rounds", done.rounds());
        let handover = done.progress[0].turns[1].clone();
        let rec = stack.turn(&handover).await?.context("hand-over turn")?;
        ensure!(
            listed_steps(&rec.text).len() == 3,
            "one batch of three: {}",
            rec.text
        );
    }
    Ok(())
}

/// R11: overlap `skip` with a run longer than the period records `skipped`
/// slots naming the running run; `buffer_one` runs exactly one buffered slot afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_slots_skip_or_buffer_one() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = overlap(&mut stack).await;
    report(&stack, r)
}

async fn overlap(stack: &mut Stack) -> Result<()> {
    let s1 = stack.create_session("skipper", None).await?;
    let s2 = stack.create_session("buffer", None).await?;
    let long = "a long run\n!sleep 7s";
    stack
        .add_schedule(&schedule("skip-me", "*/3 * * * * *", &s1, &[long]))
        .await?;
    let mut buffered = schedule("buffer-me", "*/3 * * * * *", &s2, &[long]);
    buffered.overlap = Overlap::BufferOne;
    buffered.late_threshold = Duration::from_secs(1);
    stack.add_schedule(&buffered).await?;

    // skip: the first slot fires; the next ones, while its run goes, name it.
    let slots = stack
        .wait_slots("skip-me", 3, Duration::from_secs(30))
        .await?;
    let SlotOutcome::Fired { run: first, .. } = &slots[0].outcome else {
        anyhow::bail!("first slot: {:?}", slots[0].outcome);
    };
    for s in &slots[1..3] {
        match &s.outcome {
            SlotOutcome::Skipped { reason, yielded_to } => {
                ensure!(reason == "overlap", "{reason}");
                ensure!(yielded_to.as_ref() == Some(first), "names the running run");
            }
            other => anyhow::bail!("slot {}: {other:?}", s.slot),
        }
    }

    // buffer_one: fired, then one slot held (fired once the run ends), the rest skipped.
    let first_run = stack
        .wait_slots("buffer-me", 1, Duration::from_secs(30))
        .await?
        .into_iter()
        .find_map(|s| match s.outcome {
            SlotOutcome::Fired { run, .. } => Some(run),
            _ => None,
        })
        .context("first buffer-me slot fired")?;
    let done = stack.wait_run(&first_run, Duration::from_secs(30)).await?;
    ensure!(
        matches!(done.state, RunState::Completed { .. }),
        "{:?}",
        done.state
    );
    let slots = turnstile_tests::wait_until(
        "the buffered slot to fire",
        Duration::from_secs(20),
        || async {
            let s = stack.slots("buffer-me").await?;
            let fired = s
                .iter()
                .filter(|r| matches!(r.outcome, SlotOutcome::Fired { .. }))
                .count();
            Ok((fired >= 2).then_some(s))
        },
    )
    .await?;
    // Stop both schedules before judging, so no new slots race the checks.
    for name in ["skip-me", "buffer-me"] {
        let _: turnstile_shared::schedules::ScheduleRecord = turnstile_shared::api::call(
            &stack.client,
            turnstile_shared::subjects::api::SCHEDULES_DELETE,
            &turnstile_shared::schedules::ScheduleRef { name: name.into() },
            crate::stack::API,
        )
        .await?;
    }
    let fired: Vec<_> = slots
        .iter()
        .filter(|r| matches!(r.outcome, SlotOutcome::Fired { .. }))
        .collect();
    ensure!(
        fired.len() == 2,
        "the first run and exactly one buffered slot: {slots:?}"
    );
    let SlotOutcome::Fired {
        late,
        drift_ms,
        run: second,
        ..
    } = &fired[1].outcome
    else {
        unreachable!("filtered to fired")
    };
    ensure!(
        *late && *drift_ms > 3000,
        "the buffered slot fired late, when the run ended"
    );
    ensure!(
        slots
            .iter()
            .filter(|r| r.slot > fired[0].slot && r.slot < done_end(&done))
            .filter(|r| matches!(&r.outcome, SlotOutcome::Skipped { reason, .. } if reason == "buffer_full"))
            .count()
            >= 1,
        "slots beyond the one buffered were skipped: {slots:?}"
    );
    stack.wait_run(second, Duration::from_secs(30)).await?;
    Ok(())
}

fn done_end(run: &turnstile_shared::runs::RunRecord) -> chrono::DateTime<chrono::Utc> {
    match &run.state {
        RunState::Completed { ended_at, .. } | RunState::Failed { ended_at, .. } => *ended_at,
        _ => chrono::Utc::now(),
    }
}

/// R11 with two scheduler replicas: one is SIGKILLed while slots fire; every slot still has
/// exactly one record, no slot fires twice, and each fired slot's run ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_schedulers_one_killed_fire_each_slot_once() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = two_replicas(&mut stack).await;
    report(&stack, r)
}

async fn two_replicas(stack: &mut Stack) -> Result<()> {
    stack.spawn_scheduler("s2")?;
    let s = stack.create_session("ticker", None).await?;
    let mut spec = schedule("every-2s", "*/2 * * * * *", &s, &["tick"]);
    spec.overlap = Overlap::AllowAll;
    stack.add_schedule(&spec).await?;
    stack
        .wait_slots("every-2s", 3, Duration::from_secs(30))
        .await?;
    stack.schedulers.get_mut("s1").context("s1")?.kill().await?;
    let before = stack.slots("every-2s").await?.len();
    stack
        .wait_slots("every-2s", before + 3, Duration::from_secs(30))
        .await?;
    let _: turnstile_shared::schedules::ScheduleRecord = turnstile_shared::api::call(
        &stack.client,
        turnstile_shared::subjects::api::SCHEDULES_DELETE,
        &turnstile_shared::schedules::ScheduleRef {
            name: "every-2s".into(),
        },
        crate::stack::API,
    )
    .await?;
    let slots = stack.slots("every-2s").await?;
    // One record per slot, 2 s apart, no gap and no repeat.
    for pair in slots.windows(2) {
        ensure!(
            (pair[1].slot - pair[0].slot).num_seconds() == 2,
            "slots {} and {} are not consecutive",
            pair[0].slot,
            pair[1].slot
        );
    }
    let runs: Vec<_> = slots
        .iter()
        .filter_map(|r| match &r.outcome {
            SlotOutcome::Fired { run, .. } => Some(run.clone()),
            _ => None,
        })
        .collect();
    ensure!(
        runs.len() == slots.len(),
        "allow_all fires every slot: {slots:?}"
    );
    for run in &runs {
        let done = stack.wait_run(run, Duration::from_secs(30)).await?;
        ensure!(
            matches!(done.state, RunState::Completed { .. }),
            "{run}: {:?}",
            done.state
        );
    }
    // Each fired slot typed its message once.
    let transcript = stack.transcript(&s).await?;
    ensure!(
        transcript.iter().filter(|m| m.as_str() == "tick").count() == runs.len(),
        "{} ticks for {} fired slots",
        transcript.len(),
        runs.len()
    );
    Ok(())
}

/// R11 catch-up: the only scheduler is down for several slots; when it comes back the slots
/// it missed are recorded `missed` and only the latest fires (policy `latest`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_back_from_downtime_catches_up_the_latest_slot() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = catch_up(&mut stack).await;
    report(&stack, r)
}

async fn catch_up(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("catcher", None).await?;
    let mut spec = schedule("catch-me", "*/2 * * * * *", &s, &["tick"]);
    spec.late_threshold = Duration::from_secs(1);
    stack.add_schedule(&spec).await?;
    stack
        .wait_slots("catch-me", 1, Duration::from_secs(30))
        .await?;
    stack.schedulers.get_mut("s1").context("s1")?.kill().await?;
    let down_at = chrono::Utc::now();
    // Down for at least three slots (the wait is on real slots passing, not a fixed sleep).
    turnstile_tests::wait_until("three slots to pass", Duration::from_secs(20), || async {
        Ok(((chrono::Utc::now() - down_at).num_milliseconds() > 7_000).then_some(()))
    })
    .await?;
    let before = stack.slots("catch-me").await?.len();
    stack.spawn_scheduler("s1b")?;
    let slots = stack
        .wait_slots("catch-me", before + 3, Duration::from_secs(30))
        .await?;
    let caught: Vec<_> = slots
        .iter()
        .filter(|r| r.slot > down_at && r.recorded_at > down_at)
        .collect();
    let missed = caught
        .iter()
        .filter(
            |r| matches!(&r.outcome, SlotOutcome::Missed { reason } if reason == "catchup_latest"),
        )
        .count();
    ensure!(
        missed >= 2,
        "the older missed slots are recorded missed: {caught:?}"
    );
    ensure!(
        caught
            .iter()
            .any(|r| matches!(&r.outcome, SlotOutcome::Fired { .. })),
        "the latest fires: {caught:?}"
    );
    for pair in slots.windows(2) {
        ensure!(
            (pair[1].slot - pair[0].slot).num_seconds() == 2,
            "no slot without a record"
        );
    }
    Ok(())
}

/// Overlap `cancel_other` (R7, R11): a slot that comes while the previous run goes cancels it
/// (it stops after its turn in flight, `failed: cancelled`, never typing its next message)
/// and fires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_other_stops_the_running_run_and_fires() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = cancel_other(&mut stack).await;
    report(&stack, r)
}

async fn cancel_other(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("canceller", None).await?;
    let mut spec = schedule(
        "cancel-me",
        "*/4 * * * * *",
        &s,
        &["long\n!sleep 5s", "second message"],
    );
    spec.overlap = Overlap::CancelOther;
    stack.add_schedule(&spec).await?;
    let slots = stack
        .wait_slots("cancel-me", 2, Duration::from_secs(30))
        .await?;
    let _: turnstile_shared::schedules::ScheduleRecord = turnstile_shared::api::call(
        &stack.client,
        turnstile_shared::subjects::api::SCHEDULES_DELETE,
        &turnstile_shared::schedules::ScheduleRef {
            name: "cancel-me".into(),
        },
        crate::stack::API,
    )
    .await?;
    let runs: Vec<_> = slots
        .iter()
        .take(2)
        .map(|r| match &r.outcome {
            SlotOutcome::Fired { run, .. } => Ok(run.clone()),
            other => Err(anyhow::anyhow!("slot {}: {other:?}", r.slot)),
        })
        .collect::<Result<_>>()?;
    let first = stack.wait_run(&runs[0], Duration::from_secs(30)).await?;
    match &first.state {
        RunState::Failed {
            reason,
            message_index,
            ..
        } => {
            ensure!(reason == "cancelled", "{reason}");
            ensure!(*message_index == 1, "stopped before its second message");
        }
        other => anyhow::bail!("the overlapped run ended {other:?}"),
    }
    let transcript = stack.transcript(&s).await?;
    ensure!(
        transcript.first().is_some_and(|m| m.starts_with("long")),
        "{transcript:?}"
    );
    ensure!(
        transcript.get(1).is_none_or(|m| m.starts_with("long")),
        "the cancelled run never typed its second message: {transcript:?}"
    );
    Ok(())
}

/// A slot whose record was written before the scheduler reached it, as anything but a fire
/// (here `skipped`), stays so and never becomes the schedule's last run: with overlap `skip`,
/// a last run that never started would read as still running and skip every later slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_decided_otherwise_never_blocks_the_next_fire() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = decided_otherwise(&mut stack).await;
    report(&stack, r)
}

async fn decided_otherwise(stack: &mut Stack) -> Result<()> {
    use chrono::{DurationRound, TimeDelta, Utc};
    use turnstile_shared::schedules::{slot_key, SlotRecord};
    let s = stack.create_session("pre-decided", None).await?;
    let name = "pre-decided";
    let mut spec = schedule(name, "*/2 * * * * *", &s, &["tick"]);
    spec.overlap = Overlap::Skip;
    stack.add_schedule(&spec).await?;
    // Two slots at least 4 s ahead (slots are due only once their time has come), decided
    // `skipped` before the scheduler gets to them.
    let two = TimeDelta::seconds(2);
    let first = (Utc::now() + TimeDelta::seconds(4)).duration_trunc(two)? + two;
    let slots_kv = stack
        .js
        .get_key_value(turnstile_shared::subjects::SLOTS_BUCKET)
        .await?;
    for slot in [first, first + two] {
        let rec = SlotRecord {
            schedule: name.to_string(),
            slot,
            recorded_at: Utc::now(),
            outcome: SlotOutcome::Skipped {
                reason: "decided_elsewhere".into(),
                yielded_to: None,
            },
        };
        slots_kv
            .create(slot_key(name, slot), serde_json::to_vec(&rec)?.into())
            .await
            .with_context(|| format!("pre-decide slot {slot}"))?;
    }
    // The slots after them fire and their runs complete.
    let after = wait_fired_after(stack, name, first + two).await?;
    let done = stack.wait_run(&after, Duration::from_secs(60)).await?;
    ensure!(
        matches!(done.state, RunState::Completed { .. }),
        "the run after the decided slots: {:?}",
        done.state
    );
    let slots = stack.slots(name).await?;
    for slot in [first, first + two] {
        let rec = slots
            .iter()
            .find(|r| r.slot == slot)
            .context("a decided slot's record is gone")?;
        ensure!(
            matches!(&rec.outcome, SlotOutcome::Skipped { reason, .. } if reason == "decided_elsewhere"),
            "the decided slot was overwritten: {rec:?}"
        );
    }
    // Later slots may yield to a real run still going; never to one of the decided slots'.
    let never_started = [
        turnstile_shared::schedules::slot_run(name, first),
        turnstile_shared::schedules::slot_run(name, first + two),
    ];
    let overlapped: Vec<_> = slots
        .iter()
        .filter(|r| {
            matches!(&r.outcome, SlotOutcome::Skipped { yielded_to: Some(run), .. }
                if never_started.contains(&Some(run.clone())))
        })
        .collect();
    ensure!(
        overlapped.is_empty(),
        "later slots yielded to a run that never started: {overlapped:?}"
    );
    // And those runs were never started.
    let runs_kv = stack
        .js
        .get_key_value(turnstile_shared::subjects::RUNS_BUCKET)
        .await?;
    for run in never_started.iter().flatten() {
        ensure!(
            runs_kv.get(run.as_str()).await?.is_none(),
            "the run of a slot decided `skipped` was started: {run}"
        );
    }
    Ok(())
}

/// The run of the first slot after `after` that fired.
async fn wait_fired_after(
    stack: &Stack,
    name: &str,
    after: chrono::DateTime<chrono::Utc>,
) -> Result<turnstile_shared::RunId> {
    turnstile_tests::wait_until(
        "a slot after the decided ones to fire",
        Duration::from_secs(30),
        || async {
            Ok(stack
                .slots(name)
                .await?
                .into_iter()
                .find_map(|r| match r.outcome {
                    SlotOutcome::Fired { run, .. } if r.slot > after => Some(run),
                    _ => None,
                }))
        },
    )
    .await
}

/// R11: a `buffer_one` slot held back whose hold the store lost (the schedule's write
/// acknowledged, then lost with a NATS node: the fault campaign found two such slots with no
/// record at all) is still accounted for: the scheduler's audit records it `missed`, reason
/// `record_lost`. The hold is erased here by writing the schedule's record without it, as the
/// lost write leaves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffered_slot_the_store_lost_is_recorded_missed() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = lost_buffer(&mut stack).await;
    report(&stack, r)
}

async fn lost_buffer(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::schedules::ScheduleRecord;
    use turnstile_shared::subjects;
    let s = stack.create_session("lost-buffer", None).await?;
    let mut spec = schedule(
        "lost-buffer",
        "*/3 * * * * *",
        &s,
        &["a long run\n!sleep 90s"],
    );
    spec.overlap = Overlap::BufferOne;
    stack.add_schedule(&spec).await?;
    let kv = stack.js.get_key_value(subjects::SCHEDULES_BUCKET).await?;
    // The first slot fires; the next one is held while its run goes.
    let held = turnstile_tests::wait_until("a slot held back", Duration::from_secs(30), || async {
        let Some(entry) = kv.entry("lost-buffer").await? else {
            return Ok(None);
        };
        let record: ScheduleRecord = serde_json::from_slice(&entry.value)?;
        Ok(record.buffered.map(|slot| (slot, record, entry.revision)))
    })
    .await?;
    let (slot, mut record, revision) = held;
    record.buffered = None;
    kv.update("lost-buffer", serde_json::to_vec(&record)?.into(), revision)
        .await?;
    let recorded = turnstile_tests::wait_until(
        "the lost slot's record",
        Duration::from_secs(90),
        || async {
            let slots = stack.slots("lost-buffer").await?;
            Ok(slots.into_iter().find(|r| r.slot == slot))
        },
    )
    .await?;
    let _: ScheduleRecord = turnstile_shared::api::call(
        &stack.client,
        subjects::api::SCHEDULES_DELETE,
        &turnstile_shared::schedules::ScheduleRef {
            name: "lost-buffer".into(),
        },
        crate::stack::API,
    )
    .await?;
    ensure!(
        matches!(&recorded.outcome, SlotOutcome::Missed { reason } if reason == "record_lost"),
        "the lost slot was recorded {:?}",
        recorded.outcome
    );
    Ok(())
}
