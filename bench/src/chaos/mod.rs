//! `turnstile-bench chaos`: a fault campaign. A mixed workload (`workload`) runs on a whole
//! deployment of processes (`stack`: two replicas of every service, two transport hosts with
//! mock agents, one nats-server or a three-node cluster with `--replicas 3`, its nodes local
//! processes or docker-compose.yml's cluster profile with `--nats compose`: `nodes`) while a
//! plan drawn
//! from a seed (`plan`) kills, pauses and cuts them, several faults at once (`inject`). Then
//! the faults stop, the stack must go quiet within a bound (liveness, `end`), and the history
//! it left (`history`) is checked against the rules (`check`). Prints the seed first (the same seed
//! replays the same plan) and the figures last, as JSON; exits non-zero on any violation.
//!
//! `turnstile-bench chaos [--seed N] [--minutes M] [--every SECS] [--replicas 3]
//! [--nats local|compose] [--out FILE] [--png FILE] [--plan]` (`--png`: the timeline of faults against progress;
//! `--plan`: print the plan and stop).

pub mod check;
mod disk;
mod end;
mod history;
mod inject;
mod net;
mod nodes;
mod plan;
mod signal;
mod stack;
mod timeline;
mod workload;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;
use tokio::sync::Mutex;
use turnstile_shared::api::SessionView;
use turnstile_shared::subjects::api as subj;

use end::{memory, quiet, LIVENESS_BOUND};
use history::History;
use inject::{Injected, Injector};
use stack::{ChaosStack, BROKERS, HOSTS, LANES, SCHEDULERS};

/// A service's resident memory above this at the end is a violation.
const MEMORY_BOUND_KB: u64 = 1024 * 1024;

struct Args {
    seed: u64,
    window: Duration,
    every: Duration,
    replicas: usize,
    nats: nodes::Kind,
    out: Option<std::path::PathBuf>,
    png: Option<std::path::PathBuf>,
    plan_only: bool,
}

const USAGE: &str = "\
usage: turnstile-bench chaos [--seed N] [--minutes M] [--every SECS] [--replicas 1|3]
                             [--nats local|compose] [--out history.json]
                             [--png timeline.png] [--plan]
  --seed N        the fault plan's seed (default: random, printed; the same seed replays it)
  --minutes M     how long faults are injected (default 10)
  --every SECS    mean time between faults (default 6)
  --replicas 1|3  one nats-server, or a three-node cluster in network namespaces (default 1)
  --nats compose  the three nodes are docker-compose.yml's cluster profile under Docker
                  (implies --replicas 3; default: local processes)
  --out, --png    the figures as JSON, the timeline as a PNG
  --plan          print the fault plan and exit";

fn parse(args: &[String]) -> Result<Args> {
    let mut out = Args {
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
        window: Duration::from_secs(600),
        every: Duration::from_secs(6),
        replicas: 1,
        nats: nodes::Kind::Local,
        out: None,
        png: None,
        plan_only: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--seed" => out.seed = value()?.parse().context("--seed")?,
            "--minutes" => {
                let m: f64 = value()?.parse().context("--minutes")?;
                if !(m > 0.0 && m <= 24.0 * 60.0) {
                    bail!("--minutes must be above 0 and at most a day");
                }
                out.window = Duration::from_secs_f64(m * 60.0);
            }
            "--every" => out.every = Duration::from_secs_f64(value()?.parse().context("--every")?),
            "--replicas" => {
                out.replicas = value()?.parse().context("--replicas")?;
                if out.replicas != 1 && out.replicas != 3 {
                    bail!("--replicas takes 1 or 3");
                }
            }
            "--nats" => out.nats = value()?.parse()?,
            "--out" => out.out = Some(value()?.into()),
            "--png" => out.png = Some(value()?.into()),
            "--plan" => out.plan_only = true,
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("chaos: unknown argument {other:?}\n{USAGE}"),
        }
    }
    if out.nats == nodes::Kind::Compose {
        out.replicas = 3;
    }
    Ok(out)
}

fn targets(replicas: usize) -> plan::Targets {
    let mut services: Vec<String> = LANES.iter().map(|r| format!("lane-{r}")).collect();
    services.extend(BROKERS.iter().map(|r| format!("broker-{r}")));
    services.extend(SCHEDULERS.iter().map(|r| format!("scheduler-{r}")));
    services.extend(HOSTS.iter().map(|h| format!("transport-{h}")));
    plan::Targets {
        services,
        transports: HOSTS.iter().map(|h| format!("transport-{h}")).collect(),
        hosts: HOSTS.iter().map(|h| h.to_string()).collect(),
        nats_nodes: if replicas > 1 {
            (0..replicas).map(|i| format!("nats-{i}")).collect()
        } else {
            Vec::new()
        },
        stores: (0..replicas).map(|i| format!("nats-{i}")).collect(),
    }
}

pub async fn run(args: &[String]) -> Result<()> {
    let args = parse(args)?;
    let plan = plan::draw(args.seed, args.window, args.every, &targets(args.replicas));
    eprintln!(
        "chaos: seed {} ({} faults over {:.1} min, {} nats node(s){}); replay with --seed {}",
        args.seed,
        plan.len(),
        args.window.as_secs_f64() / 60.0,
        args.replicas,
        if args.nats == nodes::Kind::Compose {
            ", docker-compose.yml's cluster profile"
        } else {
            ""
        },
        args.seed
    );
    if args.plan_only {
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    // Registered before anything is set up: a signal from here on tears the stack down.
    let mut stop = Stop::register()?;
    let stack = Arc::new(Mutex::new(
        ChaosStack::start(args.replicas, args.nats).await?,
    ));
    tokio::select! {
        biased;
        signal = stop.recv() => {
            let mut stack = stack.lock().await;
            stack.keep();
            let dir = stack.log_dir().to_path_buf();
            stack.teardown();
            bail!(
                "chaos: seed {}: stopped by {signal} before the end; every process, the \
                 cluster's network and the store mounts are removed; logs in {}",
                args.seed,
                dir.display()
            )
        }
        result = campaign(&args, plan, stack.clone()) => result,
    }
}

/// The campaign on a started stack: workload and faults, then quiet, check and figures.
async fn campaign(
    args: &Args,
    plan: Vec<plan::Fault>,
    stack: Arc<Mutex<ChaosStack>>,
) -> Result<()> {
    let (client, trace, mock_dir, log_dir) = {
        let stack = stack.lock().await;
        let client = stack.connect().await?;
        let dirs = (
            stack.step_log(),
            stack.mock_dir(),
            stack.log_dir().to_path_buf(),
        );
        (client, dirs.0, dirs.1, dirs.2)
    };
    let js = async_nats::jetstream::new(client.clone());
    let sessions = workload::create(&client, &HOSTS).await?;
    let crons = workload::schedules(&client, &sessions.scheduled, &trace).await?;
    let agents = agents_of(&client, &sessions).await?;
    let counts = workload::Counts::default();
    let started = Instant::now();
    let started_at = chrono::Utc::now();
    let injector = Arc::new(Injector::new(
        stack.clone(),
        client.clone(),
        &sessions,
        &agents,
        args.seed,
        started,
    ));
    let supervisor = {
        let stack = stack.clone();
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn({
            let stop = stop.clone();
            async move { inject::supervise(&stack, stop).await }
        });
        (stop, task)
    };
    let faults = {
        let injector = injector.clone();
        let plan = plan.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            for fault in plan {
                tokio::time::sleep_until(tokio::time::Instant::from_std(started + fault.at)).await;
                let injector = injector.clone();
                held.push(tokio::spawn(async move { injector.apply(&fault).await }));
            }
            let mut out = Vec::new();
            for h in held {
                if let Ok(i) = h.await {
                    out.push(i);
                }
            }
            out
        })
    };
    let mut driver = workload::Driver::new(&client, &sessions, &trace, args.seed, &counts);
    let mut doomed = 0;
    while started.elapsed() < args.window {
        driver.step().await;
        if doomed == 0 && started.elapsed() > args.window / 3 {
            doomed = 1;
            if let Err(e) = driver.doomed_work().await {
                eprintln!("chaos: work for the session to stop was refused: {e:#}");
            }
        } else if doomed == 1 && started.elapsed() > args.window / 2 {
            doomed = 2;
            if let Err(e) = driver.stop_doomed().await {
                eprintln!("chaos: the stop was refused: {e:#}");
            }
        }
        let pause = driver.rng.millis(200, 700);
        tokio::time::sleep(pause).await;
    }
    let injected = faults.await.context("fault task")?;
    inject::heal(&stack).await?;
    workload::pause(&client, &crons).await?;
    eprintln!("chaos: faults over; waiting for the stack to go quiet");
    let quiet_from = Instant::now();
    let liveness = quiet(&client, &js, &mock_dir, &trace, &crons).await;
    let liveness_s = quiet_from.elapsed().as_secs_f64();
    // The supervisor runs to the end, as a deployment's does: a replica that fences itself
    // as the faults stop (its lease lapsed in the last one) comes back for the liveness wait.
    supervisor.0.cancel();
    let restarted = supervisor.1.await.unwrap_or(0);
    eprintln!("chaos: the supervisor started {restarted} exited service(s) again");
    let history = History::load(&js, &mock_dir, &trace, crons).await?;
    if let Some(png) = &args.png {
        timeline::draw(png, started_at, &history, &injected)?;
    }
    let mut violations = check::check(&history);
    if let Err(e) = &liveness {
        eprintln!("chaos: not quiet within {LIVENESS_BOUND:?}: {e:#}");
    }
    let memory = memory(&stack).await;
    let over: Vec<_> = memory
        .iter()
        .filter(|(_, kb)| **kb > MEMORY_BOUND_KB)
        .map(|(s, kb)| format!("{s}: {kb} kB"))
        .collect();
    let figures = figures(
        args,
        &injected,
        &violations,
        liveness.is_ok().then_some(liveness_s),
        &history,
        &counts,
        &memory,
    );
    let text = serde_json::to_string_pretty(&figures)?;
    println!("{text}");
    if let Some(path) = &args.out {
        std::fs::write(path, &text).with_context(|| format!("write {}", path.display()))?;
    }
    for v in &violations {
        eprintln!("chaos: VIOLATION {}", serde_json::to_string(v)?);
    }
    violations.truncate(0);
    let n = figures["violations"].as_u64().unwrap_or(0);
    if n > 0 || liveness.is_err() || !over.is_empty() {
        // What the checker read, and what the completion stream still holds, beside the logs.
        let dump = log_dir.join("history.json");
        if let Err(e) = std::fs::write(&dump, serde_json::to_vec_pretty(&history)?) {
            eprintln!("chaos: write {}: {e}", dump.display());
        }
        completions_dump(&js, &log_dir.join("completions.jsonl")).await;
        stack.lock().await.keep();
        bail!(
            "chaos: seed {}: {n} violation(s), liveness {}, memory over bound {over:?}; logs in {}",
            args.seed,
            if liveness.is_ok() {
                "ok"
            } else {
                "NOT reached"
            },
            log_dir.display()
        );
    }
    Ok(())
}

/// SIGTERM and SIGINT, caught so a stopped campaign removes what it set up (a bare exit
/// would leave network namespaces, a bridge, a firewall rule and mounts behind).
struct Stop {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Stop {
    fn register() -> Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("catch SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("catch SIGINT")?,
        })
    }

    /// The name of the first signal to come.
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// Every message still on the completion stream, one JSON line each (subject, sequence,
/// payload), for a failed campaign's post-mortem.
async fn completions_dump(js: &async_nats::jetstream::Context, path: &std::path::Path) {
    use async_nats::jetstream::stream::DirectGetErrorKind;
    let Ok(stream) = js
        .get_stream_no_info(turnstile_shared::subjects::COMPLETION_STREAM)
        .await
    else {
        return;
    };
    let mut out = String::new();
    let mut seq = 0;
    loop {
        match stream
            .direct_get_next_for_subject(turnstile_shared::subjects::COMPLETION_ALL, Some(seq + 1))
            .await
        {
            Ok(m) => {
                seq = m.sequence;
                out.push_str(&format!(
                    "{}\n",
                    json!({"subject": m.subject.as_str(), "seq": m.sequence,
                        "payload": String::from_utf8_lossy(&m.payload)})
                ));
            }
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => break,
            Err(_) => break,
        }
    }
    let _ = std::fs::write(path, out);
}

/// The sessions whose agents a fault may kill, with their hosts.
async fn agents_of(
    client: &async_nats::Client,
    sessions: &workload::Sessions,
) -> Result<Vec<(String, turnstile_shared::SessionId)>> {
    let mut out = Vec::new();
    for s in sessions.manual.iter().chain(&sessions.scheduled) {
        let view: SessionView = workload::call(
            client,
            subj::SESSION_SHOW,
            &turnstile_shared::api::SessionRef { session: s.clone() },
        )
        .await?;
        out.push((view.session.host.to_string(), s.clone()));
    }
    Ok(out)
}

fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted.get(rank.min(sorted.len() - 1)).copied()
}

fn figures(
    args: &Args,
    injected: &[Injected],
    violations: &[check::Violation],
    liveness_s: Option<f64>,
    history: &History,
    counts: &workload::Counts,
    memory: &BTreeMap<String, u64>,
) -> serde_json::Value {
    let mut by_kind: BTreeMap<&str, Vec<&Injected>> = BTreeMap::new();
    for i in injected {
        by_kind.entry(i.kind).or_default().push(i);
    }
    let faults: serde_json::Map<String, serde_json::Value> = by_kind
        .iter()
        .map(|(kind, list)| {
            let applied: Vec<_> = list.iter().filter(|i| i.skipped.is_none()).collect();
            let mut rec: Vec<u64> = applied.iter().filter_map(|i| i.recovery_ms).collect();
            rec.sort_unstable();
            (
                kind.to_string(),
                json!({
                    "injected": applied.len(),
                    "not_applicable": list.len() - applied.len(),
                    "recovered": rec.len(),
                    "recovery_p50_ms": percentile(&rec, 50.0),
                    "recovery_p99_ms": percentile(&rec, 99.0),
                    "recovery_max_ms": rec.last(),
                }),
            )
        })
        .collect();
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for v in violations {
        *kinds.entry(v.kind()).or_default() += 1;
    }
    json!({
        "seed": args.seed,
        "minutes": args.window.as_secs_f64() / 60.0,
        "nats_nodes": args.replicas,
        "nats": if args.nats == nodes::Kind::Compose { "compose cluster profile" } else { "local" },
        "faults": faults,
        "timeline": injected,
        "violations": violations.len(),
        "violations_by_kind": kinds,
        "violation_list": violations,
        "liveness_s": liveness_s,
        "liveness_bound_s": LIVENESS_BOUND.as_secs(),
        "workload": {
            "turns_sent": counts.turns.load(Ordering::Relaxed),
            "runs_started": counts.runs.load(Ordering::Relaxed),
            "cancels": counts.cancels.load(Ordering::Relaxed),
            "retries": counts.retries.load(Ordering::Relaxed),
            "refused_calls": counts.refused.load(Ordering::Relaxed),
        },
        "history": {
            "turns": history.turns.len(),
            "executions": history.executions.len(),
            "nested_steps": history.executions.values().filter(|e| e.parent.as_ref().is_some_and(|p| p.as_str().starts_with("stp_"))).count(),
            "background_agents": history.executions.values().filter(|e| matches!(e.work, Some(turnstile_shared::execution::StepWork::Agent { .. }))).count(),
            "runs": history.runs.len(),
            "slots": history.slots.len(),
            "step_starts": history.step_starts.values().sum::<u32>(),
        },
        "memory_kb": memory,
    })
}
