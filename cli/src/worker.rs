//! `turnstile step work --queue Q -- CMD ...`: a worker for `external` steps. It takes step
//! work from `ts.step.external.<Q>`, runs CMD for each (the step's input in
//! `TURNSTILE_STEP_INPUT`, its credentials in `TURNSTILE_STEP`/`TURNSTILE_STEP_TOKEN`, so CMD
//! can start child steps), and reports progress and the result with the step's own token.

use std::process::{ExitCode, Stdio};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use turnstile_shared::api;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::execution::{exec_reason, StepResult, StepWork};
use turnstile_shared::principal::Principal;
use turnstile_shared::step_api::{step_kind, Report, ReportAck, StepReport, StepWorkItem};
use turnstile_shared::subjects::api as subj;
use turnstile_shared::topology::{self, TopologyConfig};

const CALL_TIMEOUT: Duration = Duration::from_secs(10);
const HEARTBEAT: Duration = Duration::from_secs(5);
const TAIL: usize = 20;

pub async fn run(
    url: &str,
    queue: String,
    once: bool,
    command: Vec<String>,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(!command.is_empty(), "give the command to run after `--`");
    anyhow::ensure!(
        turnstile_shared::ids::is_token(&queue),
        "queue {queue:?} must be letters, digits, '-' or '_'"
    );
    let client = turnstile_shared::config::connect_once(url, "turnstile-worker").await?;
    let js = async_nats::jetstream::new(client.clone());
    let consumer = topology::ensure_step_external_consumer(&js, &TopologyConfig::default(), &queue)
        .await
        .context("open the external step queue")?;
    let worker = format!("worker-{queue}/{}", uuid::Uuid::now_v7().simple());
    let mut messages = consumer.messages().await.context("pull step work")?;
    eprintln!("turnstile worker {worker}: waiting for steps on queue {queue}");
    while let Some(msg) = messages.next().await {
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                eprintln!("pull: {e}");
                continue;
            }
        };
        let item = Envelope::decode(&msg.payload)
            .and_then(|env| env.expect_kind(step_kind::WORK).map(|()| env))
            .and_then(|env| env.data_as::<StepWorkItem>());
        let item = match item {
            Ok(i) => i,
            Err(e) => {
                eprintln!("unreadable step work refused: {e}");
                let _ = msg.ack_with(async_nats::jetstream::AckKind::Term).await;
                continue;
            }
        };
        let input = match &item.work {
            StepWork::External { input, .. } => input.clone(),
            StepWork::Command { .. } | StepWork::Agent { .. } => serde_json::Value::Null,
        };
        let started = report(
            &client,
            &item,
            Report::Started {
                worker: worker.clone(),
            },
        )
        .await?;
        if !started.stop {
            let outcome = execute(&client, &msg, &item, &input, &command).await;
            report(&client, &item, outcome).await?;
        }
        msg.double_ack()
            .await
            .map_err(|e| anyhow::anyhow!("ack step work: {e}"))?;
        if once {
            break;
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn execute(
    client: &async_nats::Client,
    msg: &async_nats::jetstream::Message,
    item: &StepWorkItem,
    input: &serde_json::Value,
    command: &[String],
) -> Report {
    let mut child = match tokio::process::Command::new(&command[0])
        .args(&command[1..])
        .env("TURNSTILE_STEP", item.step.as_str())
        .env("TURNSTILE_STEP_TOKEN", &item.token)
        .env("TURNSTILE_STEP_INPUT", input.to_string())
        .env_remove("TURNSTILE_SESSION")
        .env_remove("TURNSTILE_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            return Report::Failed {
                reason: exec_reason::SPAWN_FAILED.into(),
                result: StepResult {
                    exit_code: None,
                    summary: format!("spawn {}: {e}", command[0]),
                    output: vec![],
                },
            }
        }
    };
    let stdout = child.stdout.take();
    let reader = tokio::spawn(async move {
        use tokio::io::AsyncBufReadExt;
        let mut tail = std::collections::VecDeque::new();
        if let Some(out) = stdout {
            let mut lines = tokio::io::BufReader::new(out).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                if tail.len() == TAIL {
                    tail.pop_front();
                }
                tail.push_back(l);
            }
        }
        tail.into_iter().collect::<Vec<String>>()
    });
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + HEARTBEAT, HEARTBEAT);
    let status = loop {
        tokio::select! {
            s = child.wait() => break s,
            _ = tick.tick() => {
                let _ = msg.ack_with(async_nats::jetstream::AckKind::Progress).await;
                if let Ok(ack) = report(client, item, Report::Heartbeat).await {
                    if ack.stop {
                        let _ = child.kill().await;
                    }
                }
            }
        }
    };
    let output = reader.await.unwrap_or_default();
    let last = output.last().cloned().unwrap_or_default();
    match status {
        Ok(s) if s.success() => Report::Completed {
            result: StepResult {
                exit_code: Some(0),
                summary: if last.is_empty() {
                    "exit 0".into()
                } else {
                    last
                },
                output,
            },
        },
        Ok(s) => Report::Failed {
            reason: exec_reason::EXIT_STATUS.into(),
            result: StepResult {
                exit_code: s.code(),
                summary: format!("{s}"),
                output,
            },
        },
        Err(e) => Report::Failed {
            reason: exec_reason::WORKER_LOST.into(),
            result: StepResult {
                exit_code: None,
                summary: format!("wait: {e}"),
                output,
            },
        },
    }
}

async fn report(
    client: &async_nats::Client,
    item: &StepWorkItem,
    report: Report,
) -> anyhow::Result<ReportAck> {
    let req = StepReport {
        step: item.step.clone(),
        token: item.token.clone(),
        report,
    };
    let subject = Principal::Step(item.step.clone()).steps(subj::REPORT);
    api::call(client, &subject, &req, CALL_TIMEOUT)
        .await
        .with_context(|| format!("report step {}", item.step))
}
