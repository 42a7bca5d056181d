//! `turnstile host list`: the live hosts (their heartbeat has not lapsed), the sessions placed
//! on each, and how long ago each last heartbeat was.

use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;
use turnstile_shared::api::{self, HostView, ListHosts};
use turnstile_shared::subjects::api as subj;

#[derive(Subcommand)]
pub enum HostCommand {
    /// Live hosts, their sessions and last heartbeat.
    List {
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(url: &str, cmd: HostCommand) -> anyhow::Result<ExitCode> {
    let client = turnstile_shared::config::connect_once(url, "turnstile-cli").await?;
    let HostCommand::List { json } = cmd;
    let hosts: Vec<HostView> = api::call(
        &client,
        subj::SESSION_HOSTS,
        &ListHosts {},
        Duration::from_secs(10),
    )
    .await?;
    if json {
        println!("{}", serde_json::to_string(&hosts)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<16} {:>8} {:>10}  {:<10} SESSIONS",
        "HOST", "SESSIONS", "HEARTBEAT", "VERSION"
    );
    for h in &hosts {
        let ago = (chrono::Utc::now() - h.host.heartbeat_at).num_milliseconds();
        println!(
            "{:<16} {:>8} {:>8}ms  {:<10} {}",
            h.host.name,
            h.sessions.len(),
            ago.max(0),
            h.host.version,
            h.sessions
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    Ok(ExitCode::SUCCESS)
}
