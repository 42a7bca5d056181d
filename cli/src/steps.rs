//! `turnstile step ...`, `turnstile tree` and `turnstile cancel`: thin calls to the broker's
//! step and execution APIs. `step` acts with the credentials the caller was launched with
//! (`TURNSTILE_SESSION` + `TURNSTILE_TOKEN`, or `TURNSTILE_STEP` + `TURNSTILE_STEP_TOKEN`).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use turnstile_shared::api;
use turnstile_shared::execution::{ExecutionRecord, Scope};
use turnstile_shared::principal::{self, Principal};
use turnstile_shared::step_api::{
    Caller, Cancelled, ExecRef, ListSteps, StartStep, StepKind, StepStatus, TreeNode,
};
use turnstile_shared::subjects::api as subj;
use turnstile_shared::{ExecutionId, StepId};

const API_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a step start keeps retrying a lost request (the step's id makes a repeat return
/// the first attempt's step): past a node cut off or a broker replica's death.
const START_DEADLINE: Duration = Duration::from_secs(60);
/// `--count` ceiling: one call starts at most this many steps.
const MAX_COUNT: u32 = 10_000;

#[derive(Subcommand)]
pub enum StepCommand {
    /// Start a child execution of the turn your session's lane holds now; prints its id.
    Start {
        #[arg(long)]
        name: String,
        /// `session` (the default: outlives this turn; ends when it finishes, its run fails or
        /// the session stops), `turn` (dies with this turn however it ends) or `detached`
        /// (independent; you are told of its end). `run` is read as `session`.
        #[arg(long, default_value = "session")]
        scope: Scope,
        /// `command` (run CMD on the session's host), `external` (for a worker on --queue) or
        /// `agent` (a background agent working on --prompt).
        #[arg(long, default_value = "command")]
        kind: String,
        /// What an `agent` step should do.
        #[arg(long)]
        prompt: Option<String>,
        /// The `external` work queue.
        #[arg(long)]
        queue: Option<String>,
        /// JSON input for an `external` step.
        #[arg(long)]
        input: Option<String>,
        /// Start this many identical steps (named NAME-1 .. NAME-N).
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long)]
        json: bool,
        /// The command and its arguments (after `--`).
        #[arg(last = true)]
        command: Vec<String>,
    },
    /// One step you own or watch.
    Status {
        id: StepId,
        #[arg(long)]
        json: bool,
    },
    /// Your session's steps, newest first.
    List {
        #[command(flatten)]
        page: crate::paging::PageArgs,
        #[arg(long)]
        json: bool,
    },
    /// Serve `external` steps of a queue: run the command for each and report its result.
    Work {
        #[arg(long)]
        queue: String,
        /// Exit after one step.
        #[arg(long)]
        once: bool,
        #[arg(last = true)]
        command: Vec<String>,
    },
}

fn caller() -> anyhow::Result<Caller> {
    Caller::from_env().context(
        "no credentials: set TURNSTILE_SESSION and TURNSTILE_TOKEN (an agent's terminal has \
         them), or TURNSTILE_STEP and TURNSTILE_STEP_TOKEN (a step's process has them)",
    )
}

pub async fn run(url: &str, cmd: StepCommand) -> anyhow::Result<ExitCode> {
    if let StepCommand::Work {
        queue,
        once,
        command,
    } = cmd
    {
        return crate::worker::run(url, queue, once, command).await;
    }
    // Every step command acts for the caller; its connection is made as the caller too.
    let caller = caller()?;
    let client = principal::connect(url, "turnstile-step", Some(&caller)).await?;
    let principal = Principal::of(&caller);
    match cmd {
        StepCommand::Start {
            name,
            scope,
            kind,
            prompt,
            queue,
            input,
            count,
            json,
            command,
        } => {
            if count == 0 || count > MAX_COUNT {
                anyhow::bail!("--count must be 1..={MAX_COUNT}");
            }
            let work = match kind.as_str() {
                "command" => {
                    if command.is_empty() {
                        anyhow::bail!("a command step needs the command after `--`");
                    }
                    StepKind::Command { argv: command }
                }
                "external" => StepKind::External {
                    queue: queue.context("an external step needs --queue")?,
                    input: match input {
                        Some(s) => serde_json::from_str(&s).context("--input is not JSON")?,
                        None => serde_json::Value::Null,
                    },
                },
                "agent" => StepKind::Agent {
                    prompt: prompt.context("an agent step needs --prompt")?,
                },
                other => {
                    anyhow::bail!("unknown step kind {other:?} (known: command, external, agent)")
                }
            };
            let names: Vec<String> = if count == 1 {
                vec![name]
            } else {
                (1..=count).map(|i| format!("{name}-{i}")).collect()
            };
            // Started concurrently, a bounded number at a time.
            let mut started = Vec::with_capacity(names.len());
            for chunk in names.chunks(64) {
                let calls = chunk.iter().map(|n| {
                    let req = StartStep {
                        caller: caller.clone(),
                        name: n.clone(),
                        scope,
                        work: work.clone(),
                        id: Some(StepId::new()),
                    };
                    let client = client.clone();
                    let subject = principal.steps(subj::START);
                    async move {
                        api::call_idempotent::<_, ExecutionRecord>(
                            &client,
                            &subject,
                            &req,
                            API_TIMEOUT,
                            START_DEADLINE,
                        )
                        .await
                    }
                });
                for r in futures::future::join_all(calls).await {
                    started.push(r?);
                }
            }
            for rec in &started {
                if json {
                    println!("{}", serde_json::to_string(rec)?);
                } else {
                    println!("{} started", rec.id);
                }
            }
        }
        StepCommand::Status { id, json } => {
            let req = StepStatus { caller, step: id };
            let subject = principal.steps(subj::STATUS);
            let rec: ExecutionRecord = api::call(&client, &subject, &req, API_TIMEOUT).await?;
            if json {
                println!("{}", serde_json::to_string(&rec)?);
            } else {
                println!("{}", line(&rec));
            }
        }
        StepCommand::List { page, json } => {
            let req = ListSteps {
                caller,
                page: page.request(),
            };
            let subject = principal.steps(subj::LIST);
            let page: turnstile_shared::page::Page<ExecutionRecord> =
                api::call(&client, &subject, &req, API_TIMEOUT).await?;
            if json {
                println!("{}", serde_json::to_string(&page)?);
            } else {
                crate::paging::more(&page);
                for r in &page.items {
                    println!("{}", line(r));
                }
            }
        }
        StepCommand::Work { .. } => {}
    }
    Ok(ExitCode::SUCCESS)
}

/// A client for the exec API: in an agent's terminal (or a step's process) it acts for that
/// session (or step) and reaches only its executions; elsewhere it is the operator's.
async fn exec_client(url: &str) -> anyhow::Result<(async_nats::Client, Principal)> {
    let caller = Caller::from_env();
    let principal = caller.as_ref().map_or(Principal::Operator, Principal::of);
    let client = principal::connect(url, "turnstile-cli", caller.as_ref()).await?;
    Ok((client, principal))
}

/// `turnstile tree ID [--json]`.
pub async fn tree(url: &str, id: ExecutionId, json: bool) -> anyhow::Result<ExitCode> {
    let (client, principal) = exec_client(url).await?;
    let subject = principal.exec(subj::TREE);
    let node: TreeNode = api::call(&client, &subject, &ExecRef { id }, API_TIMEOUT).await?;
    if json {
        println!("{}", serde_json::to_string(&node)?);
    } else {
        print_tree(&node, 0);
    }
    Ok(ExitCode::SUCCESS)
}

/// `turnstile cancel ID`.
pub async fn cancel(url: &str, id: ExecutionId, json: bool) -> anyhow::Result<ExitCode> {
    let (client, principal) = exec_client(url).await?;
    let subject = principal.exec(subj::CANCEL);
    let out: Cancelled = api::call(&client, &subject, &ExecRef { id }, API_TIMEOUT).await?;
    if json {
        println!("{}", serde_json::to_string(&out)?);
    } else if out.cancelled.is_empty() {
        println!("nothing to cancel (already ended)");
    } else {
        for id in &out.cancelled {
            println!("{id} cancelled");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_tree(node: &TreeNode, depth: usize) {
    let open = if node.record.status.is_terminal() && !node.settled {
        "  (children still running)"
    } else {
        ""
    };
    println!("{}{}{open}", "  ".repeat(depth), line(&node.record));
    for child in &node.nodes {
        print_tree(child, depth + 1);
    }
}

/// `id  kind  status  duration  name  [scope]`.
fn line(r: &ExecutionRecord) -> String {
    let duration = match (r.status.started_at(), r.status.ended_at()) {
        (Some(s), Some(e)) => {
            turnstile_shared::duration::format((e - s).to_std().unwrap_or_default())
        }
        (Some(s), None) => format!(
            "{} so far",
            turnstile_shared::duration::format(
                (chrono::Utc::now() - s).to_std().unwrap_or_default()
            )
        ),
        _ => "-".to_string(),
    };
    let kind = serde_json::to_value(r.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    format!(
        "{}  {:<8} {:<9} {:>10}  {}  [{}]  {}",
        r.id,
        kind,
        r.status.name(),
        duration,
        r.name,
        r.scope,
        r.status.summary()
    )
}
