//! `turnstile`: the operator CLI, `turnstile dev` (the whole stack on one machine) and the
//! bundled `turnstile mock-agent`.
//!
//! # Layout
//!
//! `main` parses the command line and calls one module's `run`. Each module is one command
//! group that talks to the services over NATS (`turnstile_shared::api`); the few calls between
//! modules go down this list, never up:
//!
//! * `admin`: `turnstile admin provision`, creates the streams and buckets. Leaf.
//! * `session`: `turnstile session ...`, the session-lane API (create, list, show, send, stop).
//! * `schedule`: `turnstile schedule ...`, the scheduler API. Calls `runs` (printers, limits).
//! * `runs`: `turnstile run ...`, the runs API (start, show, retry, cancel, list). Leaf.
//! * `steps`: `turnstile step ...`, `tree`, `cancel`: the broker's APIs. Calls `worker`.
//! * `worker`: `turnstile step work`, a worker for `external` steps. Leaf.
//! * `hosts`: `turnstile host list`, live transport hosts and their sessions. Leaf.
//! * `mcp`: `turnstile mcp`, the step tools as an MCP server over stdio. Leaf.
//! * `dev`: `turnstile dev`, nats-server and every service in this process. Calls `events`.
//! * `events`: `turnstile events`, follows `TS_EVENTS`. Leaf.
//! * `dashboard`: `turnstile dashboard`, a live web page of hosts, sessions, runs' trees and
//!   schedules. Leaf.
//! * `turnstile mock-agent` is the `turnstile_mock_agent` crate, run before any runtime starts.

mod admin;
mod dashboard;
mod dev;
mod events;
mod hosts;
mod mcp;
mod paging;
mod runs;
mod schedule;
mod session;
mod steps;
mod wait;
mod worker;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use turnstile_shared::config::NatsArgs;

#[derive(Parser)]
#[command(
    name = "turnstile",
    version,
    about = "Run coding-agent sessions unattended"
)]
struct Cli {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a local nats-server and every service in this process, with a demo session.
    Dev(dev::DevArgs),
    /// Deployment steps run with an admin identity (provision the streams and buckets).
    #[command(subcommand)]
    Admin(admin::AdminCommand),
    /// Create, inspect, message and stop sessions.
    #[command(subcommand)]
    Session(session::SessionCommand),
    /// Add, inspect, pause, trigger and backfill schedules (cron-fired runs).
    #[command(subcommand)]
    Schedule(schedule::ScheduleCommand),
    /// Start, inspect and list runs (a message sequence driven to completion on a session).
    #[command(subcommand)]
    Run(runs::RunCommand),
    /// Live transport hosts and their sessions.
    #[command(subcommand)]
    Host(hosts::HostCommand),
    /// Follow lifecycle events (`ts.events.>`).
    Events(events::EventsArgs),
    /// Serve a live web page of hosts, sessions, runs with their execution trees, and
    /// schedules (works with the read-only observer identity).
    Dashboard(dashboard::DashboardArgs),
    /// Start and inspect child executions (acts with the caller's session or step token).
    #[command(subcommand)]
    Step(steps::StepCommand),
    /// Print the execution subtree under any turn or step.
    Tree {
        id: turnstile_shared::ExecutionId,
        #[arg(long)]
        json: bool,
    },
    /// Cancel an execution and everything it owns (R7).
    Cancel {
        id: turnstile_shared::ExecutionId,
        #[arg(long)]
        json: bool,
    },
    /// An MCP server over stdio for agents (built on rmcp): tools start_step, start_agent,
    /// step_status, list_steps.
    Mcp,
    /// An interactive fake coding-agent CLI, for tests and demos.
    MockAgent {
        /// Where conversations are kept (one JSONL transcript each).
        #[arg(
            long,
            env = "TURNSTILE_MOCK_STATE_DIR",
            default_value = ".data/mock-agent"
        )]
        state_dir: PathBuf,
        /// Continue an earlier conversation.
        #[arg(long)]
        resume: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::MockAgent { state_dir, resume } = cli.command {
        // No runtime and no logging: this program owns its terminal.
        return match turnstile_mock_agent::run(turnstile_mock_agent::Args { state_dir, resume }) {
            Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
            Err(e) => {
                eprintln!("mock-agent: {e:#}");
                ExitCode::from(2)
            }
        };
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("turnstile: start runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Dev(args) => dev::run(args).await,
            Command::Admin(cmd) => admin::run(&cli.nats.url, cmd).await,
            Command::Session(cmd) => session::run(&cli.nats.url, cmd).await,
            Command::Schedule(cmd) => schedule::run(&cli.nats.url, cmd).await,
            Command::Run(cmd) => runs::run(&cli.nats.url, cmd).await,
            Command::Events(args) => events::run(&cli.nats.url, args).await,
            Command::Dashboard(args) => dashboard::run(&cli.nats.url, args).await,
            Command::Host(cmd) => hosts::run(&cli.nats.url, cmd).await,
            Command::Step(cmd) => steps::run(&cli.nats.url, cmd).await,
            Command::Tree { id, json } => steps::tree(&cli.nats.url, id, json).await,
            Command::Cancel { id, json } => steps::cancel(&cli.nats.url, id, json).await,
            Command::Mcp => mcp::run(&cli.nats.url).await,
            Command::MockAgent { .. } => Ok(ExitCode::SUCCESS),
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("turnstile: {e:#}");
            ExitCode::from(2)
        }
    }
}
