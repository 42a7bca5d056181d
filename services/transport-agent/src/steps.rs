//! `command` steps for this host: takes step work from `ts.step.command.<host>`, tells the
//! broker it started (a second attempt after a crash is refused there: a step never runs
//! twice, R14), runs the command in the session's cwd, heartbeats, stops it at once when
//! told it is cancelled (R7), and reports its exit status and the tail of its output.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use turnstile_shared::api::{self, ApiError};
use turnstile_shared::envelope::Envelope;
use turnstile_shared::execution::{exec_reason, StepResult, StepWork};
use turnstile_shared::principal::Principal;
use turnstile_shared::retry::Backoff;
use turnstile_shared::step_api::{step_kind, Report, ReportAck, StepReport, StepWorkItem};
use turnstile_shared::{consume, subjects, topology};

use crate::commands::refuse;
use crate::ctx::{Ctx, Error};
use crate::steps_held::Claim;
use crate::tail::Tail;

/// Lines of output kept for the result.
const TAIL_LINES: usize = 20;
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Retries of a report while the broker is unreachable.
const REPORT_RETRY: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));

pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) -> Result<(), Error> {
    consume::until_shutdown("step work", &shutdown, || consume(&ctx, &shutdown)).await;
    Ok(())
}

async fn consume(
    ctx: &Arc<Ctx>,
    shutdown: &CancellationToken,
) -> Result<(), consume::ConsumeError> {
    let consumer =
        topology::ensure_step_command_consumer(&ctx.js, &ctx.config.topology, &ctx.config.host)
            .await?;
    consume::each_message(consumer, shutdown, |msg| {
        handle(ctx.clone(), msg, shutdown.clone())
    })
    .await
}

async fn handle(ctx: Arc<Ctx>, msg: jetstream::Message, shutdown: CancellationToken) {
    let item = match Envelope::decode(&msg.payload)
        .and_then(|env| env.expect_kind(step_kind::WORK).map(|()| env))
        .and_then(|env| env.data_as::<StepWorkItem>())
    {
        Ok(item) => item,
        Err(e) => return refuse(&ctx, &msg, &e.to_string()).await,
    };
    let StepWork::Command { argv, cwd, .. } = &item.work else {
        return refuse(&ctx, &msg, "not a command step").await;
    };
    match ctx.claim_step(&item.step) {
        Claim::Fresh => {}
        // A redelivery while this process still runs the step (a slow heartbeat).
        Claim::Running => return,
        // It ran here and its end was reported; this copy came back (its work's ack lost):
        // the broker may not have recorded the end yet and would take a start from this
        // worker as a retry (`steps_held`).
        Claim::Finished => {
            tracing::info!(step = %item.step, "a step that ran here came back; not run again");
            let _ = msg.double_ack().await;
            return;
        }
    }
    let outcome = run_step(&ctx, &msg, &item, argv, cwd.as_deref(), &shutdown).await;
    let reported = match outcome {
        Some(report) => deliver_report(&ctx, &msg, &item, report, &shutdown).await,
        // The broker refused the start (another attempt, or it ended): nothing to run.
        None => true,
    };
    // Only now: until its report is taken, a redelivery of the step is this process's own.
    if reported {
        ctx.finish_step(&item.step);
        let _ = msg.double_ack().await;
    } else {
        ctx.release_step(&item.step);
    }
}

/// Runs the step; `None` when it must not run here.
async fn run_step(
    ctx: &Ctx,
    msg: &jetstream::Message,
    item: &StepWorkItem,
    argv: &[String],
    cwd: Option<&str>,
    shutdown: &CancellationToken,
) -> Option<Report> {
    let started = call(
        ctx,
        item,
        Report::Started {
            worker: ctx.worker.clone(),
        },
        shutdown,
    )
    .await?;
    if started.stop {
        tracing::info!(step = %item.step, status = started.status, "step not started here");
        return None;
    }
    // Subscribe before spawning, so a cancel sent the moment it starts is not missed.
    let mut cancel = match ctx
        .client
        .subscribe(subjects::step_cancel(&item.step))
        .await
    {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(step = %item.step, error = %e, "cancel subscription; relying on heartbeats");
            None
        }
    };
    let dir = cwd
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| ctx.config.data_dir.clone());
    let mut command = tokio::process::Command::new(&argv[0]);
    command
        .args(&argv[1..])
        .current_dir(&dir)
        .env("TURNSTILE_STEP", item.step.as_str())
        .env("TURNSTILE_STEP_TOKEN", &item.token)
        // The server's address only: the step's process connects as the step itself, with
        // its token, never with this transport's identity.
        .env("TURNSTILE_NATS_URL", ctx.config.agent_nats_url())
        .env_remove("TURNSTILE_SESSION")
        .env_remove("TURNSTILE_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            return Some(Report::Failed {
                reason: exec_reason::SPAWN_FAILED.to_string(),
                result: StepResult {
                    exit_code: None,
                    summary: format!("spawn `{}` in {}: {e}", argv[0], dir.display()),
                    output: Vec::new(),
                },
            })
        }
    };
    let mut tail = Tail::new(TAIL_LINES);
    if let Some(o) = child.stdout.take() {
        tail.follow(o);
    }
    if let Some(e) = child.stderr.take() {
        tail.follow(e);
    }
    let pgid = child.id();
    let mut tick = progress_ticker(ctx);
    // At most one heartbeat in flight, awaited beside the command: a broker that does not
    // answer (frozen, partitioned) must not keep the command's exit, or a cancel, unseen.
    let mut beat: Option<
        std::pin::Pin<Box<dyn std::future::Future<Output = Option<ReportAck>> + Send + '_>>,
    > = None;
    let status = loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => {
                kill_group(pgid).await;
                break Err("the transport agent stopped while it ran".to_string());
            }
            Some(_) = async { match cancel.as_mut() { Some(c) => c.next().await, None => std::future::pending().await } } => {
                kill_group(pgid).await;
                break Err("cancelled".to_string());
            }
            s = child.wait() => break Ok(s),
            ack = async { match beat.as_mut() { Some(b) => b.await, None => std::future::pending().await } } => {
                beat = None;
                if let Some(ack) = ack.filter(|a| a.stop) {
                    kill_group(pgid).await;
                    break Err(format!("stopped: the step is {}", ack.status));
                }
            }
            _ = tick.tick() => {
                let _ = msg.ack_with(AckKind::Progress).await;
                if beat.is_none() {
                    beat = Some(Box::pin(heartbeat(ctx, item)));
                }
            }
        }
    };
    let _ = child.wait().await;
    let output = tail.lines().await;
    let last = output.last().cloned().unwrap_or_default();
    Some(match status {
        Ok(Ok(s)) if s.success() => Report::Completed {
            result: StepResult {
                exit_code: Some(0),
                summary: summary("exit 0", &last),
                output,
            },
        },
        Ok(Ok(s)) => Report::Failed {
            reason: exec_reason::EXIT_STATUS.to_string(),
            result: StepResult {
                exit_code: s.code(),
                summary: summary(&format!("{s}"), &last),
                output,
            },
        },
        Ok(Err(e)) => Report::Failed {
            reason: exec_reason::WORKER_LOST.to_string(),
            result: StepResult {
                exit_code: None,
                summary: format!("wait for the command: {e}"),
                output,
            },
        },
        Err(why) => Report::Failed {
            reason: exec_reason::CANCELLED.to_string(),
            result: StepResult {
                exit_code: None,
                summary: why,
                output,
            },
        },
    })
}

fn summary(status: &str, last: &str) -> String {
    if last.is_empty() {
        status.to_string()
    } else {
        format!("{status}: {last}")
    }
}

/// Kills the step's whole process group (a shell and what it started). A system call, not
/// the `kill` program: some `kill` builds read `-KILL -<pgid>` as "every process".
async fn kill_group(pgid: Option<u32>) {
    let Some(pid) = pgid
        .and_then(|p| i32::try_from(p).ok())
        .filter(|p| *p > 1)
        .and_then(rustix::process::Pid::from_raw)
    else {
        return;
    };
    if let Err(e) = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL) {
        tracing::debug!(pgid = pid.as_raw_nonzero().get(), error = %e, "kill step process group");
    }
}

/// One report, retried while the broker is unreachable; `None` if it could not be reached
/// before shutdown.
async fn call(
    ctx: &Ctx,
    item: &StepWorkItem,
    report: Report,
    shutdown: &CancellationToken,
) -> Option<ReportAck> {
    let req = request(item, report);
    let mut delays = REPORT_RETRY.delays();
    loop {
        match send(ctx, &req).await {
            Ok(answer) => return Some(answer),
            Err(message) => {
                tracing::warn!(step = %item.step, %message, "broker unreachable; retrying report")
            }
        }
        if !delays.wait_or_cancel(shutdown).await {
            return None;
        }
    }
}

/// One heartbeat, not retried (the next tick sends another): `None` if it went unanswered.
async fn heartbeat(ctx: &Ctx, item: &StepWorkItem) -> Option<ReportAck> {
    send(ctx, &request(item, Report::Heartbeat))
        .await
        .inspect_err(|message| {
            tracing::warn!(step = %item.step, %message, "heartbeat unanswered; the next tick sends another")
        })
        .ok()
}

fn request(item: &StepWorkItem, report: Report) -> StepReport {
    StepReport {
        step: item.step.clone(),
        token: item.token.clone(),
        report,
    }
}

/// One request: the broker's answer, or why it was unreachable (no reply in time, or a
/// passing refusal). A refusal for good (the step is unknown, its token not admitted) is
/// answered as a stop, as an end is.
async fn send(ctx: &Ctx, req: &StepReport) -> Result<ReportAck, String> {
    let subject = Principal::Step(req.step.clone()).steps(subjects::api::REPORT);
    match api::call::<_, ReportAck>(&ctx.client, &subject, req, CALL_TIMEOUT).await {
        Ok(ack) => Ok(ack),
        Err(ApiError { code, message }) if code.is_transient() => Err(message),
        Err(e) => {
            tracing::warn!(step = %req.step, error = %e, "report refused");
            Ok(ReportAck {
                status: e.code.to_string(),
                stop: true,
            })
        }
    }
}

/// Ticks when the step's work message is due a progress ack (and the broker a heartbeat):
/// within the work's ack wait, at most every 5 s, first one period from now.
fn progress_ticker(ctx: &Ctx) -> tokio::time::Interval {
    let period = ctx
        .config
        .topology
        .progress_interval()
        .min(Duration::from_secs(5));
    tokio::time::interval_at(tokio::time::Instant::now() + period, period)
}

/// Reports the outcome, retrying until the broker takes it (its result must not be lost), and
/// keeps the work message in progress meanwhile, so it is not handed out again while no
/// broker answers (a redelivery would find the step still this worker's, and run it twice).
async fn deliver_report(
    ctx: &Ctx,
    msg: &jetstream::Message,
    item: &StepWorkItem,
    report: Report,
    shutdown: &CancellationToken,
) -> bool {
    let mut tick = progress_ticker(ctx);
    let delivered = call(ctx, item, report, shutdown);
    tokio::pin!(delivered);
    loop {
        tokio::select! {
            biased;
            answer = &mut delivered => return answer.is_some(),
            _ = tick.tick() => {
                let _ = msg.ack_with(AckKind::Progress).await;
            }
        }
    }
}
