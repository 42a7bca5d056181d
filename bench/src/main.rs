//! `turnstile-bench lanes`: lane hand-off latency and lane throughput, measured beside the raw
//! JetStream floor in the same run on the same nats-server. Prints one JSON object.
//! `turnstile-bench failover`: how long a SIGKILLed session-lane replica's sessions wait until
//! the survivor serves them (`failover.rs`). `turnstile-bench chaos`: a seeded fault campaign
//! checked from the history it leaves (`chaos/`). `turnstile-bench history`: checks the run
//! history (`docs/bench-history.jsonl`) against its schema and draws it as a PNG (`history.rs`).
//!
//! Layout: `floor` (publish, PubAck, durable pull, double ack: the raw JetStream floor),
//! `inproc` (the services started in this process, with the instant agent), `lanes` (hand-off
//! latency and throughput over the lanes), `completions` (a step's report to the delivery
//! turn's dispatch). `main` runs them in that order and prints the figures with their ratios
//! (`stats`: percentiles and summaries, which every benchmark's file uses).

mod chaos;
mod cluster;
mod completions;
mod deployment;
mod failover;
mod floor;
mod handoff_stages;
mod history;
mod inproc;
mod lanes;
mod plot;
mod procs;
mod scale;
mod schedules;
mod soak;
mod stats;

use anyhow::{bail, Result};

use stats::over;

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // `chaos`: the fault campaign, with options of its own (`chaos/mod.rs`).
    if args.first().map(String::as_str) == Some("chaos") {
        turnstile_shared::telemetry::init_with_default("warn");
        return chaos::run(&args[1..]).await;
    }
    // `history`: the run history file, checked and drawn (no server).
    if args.first().map(String::as_str) == Some("history") {
        return history::run(&args[1..]);
    }
    // `--auth`: on a deployment's accounts (every service on its own user, the callout on).
    let accounts = args.iter().any(|a| a == "--auth");
    args.retain(|a| a != "--auth");
    // `--replicas 3 [--sync always|default]`: on a three-node cluster, every stream with three
    // copies (the durability figures of docs/deploy.md).
    let replicas = take_option(&mut args, "--replicas")?;
    let sync = take_option(&mut args, "--sync")?
        .map(|s| cluster::Sync::parse(&s))
        .transpose()?;
    // `soak --minutes N [--retention 2m] [--png soak.png]`.
    let minutes = take_option(&mut args, "--minutes")?;
    let retention = take_option(&mut args, "--retention")?;
    let png = take_option(&mut args, "--png")?;
    let cluster = match (replicas.as_deref(), sync) {
        (None | Some("1"), None) => None,
        (Some("3"), sync) => Some(sync.unwrap_or(cluster::Sync::Default)),
        (None | Some("1"), Some(_)) => bail!("--sync applies to a cluster: add --replicas 3"),
        (Some(other), _) => bail!("--replicas takes 1 or 3, not {other}"),
    };
    if accounts && cluster.is_some() {
        bail!("--auth and --replicas 3 are measured separately");
    }
    let num =
        |i: usize, default: usize| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    match args.first().map(String::as_str) {
        Some("lanes") => {}
        Some("floor") => {
            turnstile_shared::telemetry::init_with_default("warn");
            return floor_bench(accounts, cluster, num(1, 2000)).await;
        }
        Some("schedules") => {
            let d = open_server("schedules", accounts || cluster.is_some(), &Default::default()).await?;
            return print(schedules::measure(&d, num(1, 1000)).await?);
        }
        Some("scale") => {
            let d = open_server("scale", accounts || cluster.is_some(), &Default::default()).await?;
            return print(scale::measure(&d, num(1, 10_000)).await?);
        }
        Some("soak") => {
            let minutes: f64 = minutes
                .as_deref()
                .unwrap_or("20")
                .parse()
                .map_err(|_| anyhow::anyhow!("--minutes takes a number"))?;
            let retention = retention
                .as_deref()
                .map(turnstile_shared::duration::parse)
                .transpose()?
                .unwrap_or(std::time::Duration::from_secs(120));
            let png = std::path::PathBuf::from(png.as_deref().unwrap_or("soak.png"));
            let topology = turnstile_shared::topology::TopologyConfig {
                record_retention: retention,
                tree_margin: retention,
                events_max_age: retention,
                ..Default::default()
            };
            let d = open_server("soak", accounts || cluster.is_some(), &topology).await?;
            return print(soak::measure(&d, &topology, minutes, &png).await?);
        }
        Some("failover") => {
            turnstile_shared::telemetry::init_with_default("warn");
            return failover_bench(accounts, cluster, num(1, 1000)).await;
        }
        _ => bail!(
            "usage: turnstile-bench lanes [--auth | --replicas 3 [--sync always|default]] [TURNS_ONE_SESSION=1000] [SESSIONS=100] [TURNS_EACH=20] [COMPLETIONS=200]\n       turnstile-bench floor [--auth | --replicas 3 [--sync always|default]] [ROUND_TRIPS=2000]\n       turnstile-bench failover [--auth | --replicas 3 [--sync always|default]] [SESSIONS=1000]\n       turnstile-bench schedules [SCHEDULES=1000]\n       turnstile-bench scale [SESSIONS=10000]\n       turnstile-bench soak [--minutes 20] [--retention 2m] [--png soak.png]\n       turnstile-bench history [--in docs/bench-history.jsonl] [--png bench-history.png]"
        ),
    }
    turnstile_shared::telemetry::init_with_default("warn");
    let (single, sessions, each, completions) =
        (num(1, 1000), num(2, 100), num(3, 20), num(4, 200));
    let d = match cluster {
        Some(sync) => deployment::Deployment::start_cluster(sync).await?,
        None => deployment::Deployment::start(accounts).await?,
    };
    let version = std::process::Command::new(turnstile_tests::nats_server_bin()?)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    // The deployment's provisioning step (`turnstile admin provision`): services only bind.
    let js = async_nats::jetstream::new(deployment::Deployment::connect(&d.admin).await?);
    let topology = turnstile_shared::topology::TopologyConfig {
        replicas: d.replicas,
        ..Default::default()
    };
    turnstile_shared::topology::provision(&js, &topology).await?;
    eprintln!(
        "floor: 2000 round trips, then 300 each after {:?} idle",
        floor::IDLE
    );
    let floor = floor::measure(&d, 2000).await?;
    let floor_after_idle = floor::measure_after_idle(&d, 300).await?;
    let lanes = lanes::measure(&d, single, sessions, each).await?;
    eprintln!("completions: {completions} steps");
    let completion = completions::measure(&d, completions).await?;
    let ratio_of = |v: &serde_json::Value, p: &str| over(v, &floor, p);
    let ratio = |p: &str| ratio_of(&lanes.handoff, p);
    let out = serde_json::json!({
        "nats_server": version,
        "accounts": if d.accounts { "per-service users, agents by auth callout" } else { "none (open server)" },
        "store": "file",
        "replicas": d.replicas,
        "sync_interval": cluster.map_or("default (fsync every 2 min)", cluster::Sync::describe),
        "jetstream_floor": floor,
        "lane_handoff": lanes.handoff,
        "handoff_over_floor": { "p50": ratio("p50_us"), "p99": ratio("p99_us") },
        "handoff_stages_p50_us": lanes.handoff_stages,
        "throughput": lanes.throughput,
        "completion_to_agent": completion,
        "completion_over_floor": {
            "p50": ratio_of(&completion, "p50_us"),
            "p99": ratio_of(&completion, "p99_us"),
        },
        "completion_to_running_over_floor": {
            "p50": ratio_of(&completion["to_running"], "p50_us"),
            "p99": ratio_of(&completion["to_running"], "p99_us"),
        },
        // Not the target's ratio: the same path over a floor whose round trips each start
        // after a pause, as each completion sample does (see `floor.rs`).
        "jetstream_floor_after_idle": floor_after_idle,
        "completion_over_floor_after_idle": {
            "p50": over(&completion, &floor_after_idle, "p50_us"),
        },
        // Each path over the floor measured while it ran: round trips right before and after
        // the hand-off's turns, and in blocks between the completion samples.
        "jetstream_floor_beside_handoff": lanes.floor_beside,
        "handoff_over_floor_beside": {
            "p50": over(&lanes.handoff, &lanes.floor_beside, "p50_us"),
        },
        "jetstream_floor_beside_completion": completion["floor_beside"],
        "completion_over_floor_beside": {
            "p50": over(&completion, &completion["floor_beside"], "p50_us"),
        },
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// `turnstile-bench failover`: see `failover.rs`. Needs the `turnstile-session-lane` binary of
/// the same build beside this one.
async fn failover_bench(
    accounts: bool,
    cluster: Option<cluster::Sync>,
    sessions: usize,
) -> Result<()> {
    let d = match cluster {
        Some(sync) => deployment::Deployment::start_cluster(sync).await?,
        None => deployment::Deployment::start(accounts).await?,
    };
    let js = async_nats::jetstream::new(deployment::Deployment::connect(&d.admin).await?);
    let topology = turnstile_shared::topology::TopologyConfig {
        replicas: d.replicas,
        ..Default::default()
    };
    turnstile_shared::topology::provision(&js, &topology).await?;
    let figures = failover::measure(&d, sessions).await?;
    println!("{}", serde_json::to_string_pretty(&figures)?);
    Ok(())
}

/// One open server, provisioned with `topology`, for the benchmarks measured on nothing else.
async fn open_server(
    what: &str,
    other_setup: bool,
    topology: &turnstile_shared::topology::TopologyConfig,
) -> Result<deployment::Deployment> {
    turnstile_shared::telemetry::init_with_default("warn");
    if other_setup {
        bail!("{what} runs on one open server (no --auth or --replicas)");
    }
    let d = deployment::Deployment::start(false).await?;
    let js = async_nats::jetstream::new(deployment::Deployment::connect(&d.admin).await?);
    turnstile_shared::topology::provision(&js, topology).await?;
    Ok(d)
}

fn print(figures: serde_json::Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(&figures)?);
    Ok(())
}

/// Removes `--name VALUE` from `args`; its value, if given.
fn take_option(args: &mut Vec<String>, name: &str) -> Result<Option<String>> {
    let Some(i) = args.iter().position(|a| a == name) else {
        return Ok(None);
    };
    if i + 1 >= args.len() {
        bail!("{name} needs a value");
    }
    let value = args.remove(i + 1);
    args.remove(i);
    Ok(Some(value))
}

/// `turnstile-bench floor`: the raw JetStream floor alone, on one server or a cluster (what a
/// durable hand-off costs with three copies and with `sync_interval: always`).
async fn floor_bench(
    accounts: bool,
    cluster: Option<cluster::Sync>,
    round_trips: usize,
) -> Result<()> {
    let d = match cluster {
        Some(sync) => deployment::Deployment::start_cluster(sync).await?,
        None => deployment::Deployment::start(accounts).await?,
    };
    let floor = floor::measure(&d, round_trips).await?;
    let out = serde_json::json!({
        "replicas": d.replicas,
        "sync_interval": cluster.map_or("default (fsync every 2 min)", cluster::Sync::describe),
        "jetstream_floor": floor,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
