//! `turnstile`: the operator CLI, `turnstile dev` (the whole stack on one machine) and the
//! bundled `turnstile mock-agent`.

mod dev;
mod events;
mod session;

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
    /// Create, inspect, message and stop sessions.
    #[command(subcommand)]
    Session(session::SessionCommand),
    /// Follow lifecycle events (`ts.events.>`).
    Events(events::EventsArgs),
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
            Command::Session(cmd) => session::run(&cli.nats.url, cmd).await,
            Command::Events(args) => events::run(&cli.nats.url, args).await,
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
