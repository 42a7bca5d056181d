//! `turnstile dashboard`: a live web page of what the agents are doing. It connects with the
//! identity in `--nats` (the operator's, or the read-only observer's), serves one page, and
//! streams to it one snapshot and then the lifecycle events: no loop reads KV. Nothing it
//! sends carries a token, and the server is shown without credentials.
//!
//! * `snapshot`: the one read, through the read-only APIs.
//! * `feed`: the one subscription to `ts.events.>`, shared by every page.
//! * `http`: the page, the event stream, `/snapshot`.

mod feed;
mod http;
mod snapshot;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, clap::Args)]
pub struct DashboardArgs {
    /// Serve the page on this address.
    #[arg(
        long = "http",
        env = "TURNSTILE_DASHBOARD_HTTP",
        default_value = "127.0.0.1:8090"
    )]
    pub addr: SocketAddr,
    /// Sessions shown (the most recently changed first).
    #[arg(long, default_value_t = 200)]
    pub sessions: u32,
    /// Runs shown with their trees (the newest first).
    #[arg(long, default_value_t = 20)]
    pub runs: u32,
    /// Schedules shown.
    #[arg(long, default_value_t = 100)]
    pub schedules: u32,
    /// Another name the page may be reached by (the `Host` header), besides the address it
    /// listens on and localhost: a name behind a proxy, or the machine's when listening on
    /// 0.0.0.0. Any other host is refused (a page elsewhere cannot read the dashboard through
    /// a name it points at 127.0.0.1).
    #[arg(long = "allow-host")]
    pub allow_hosts: Vec<String>,
}

pub async fn run(url: &str, args: DashboardArgs) -> anyhow::Result<ExitCode> {
    turnstile_shared::telemetry::init();
    let shutdown = CancellationToken::new();
    turnstile_shared::telemetry::cancel_on_signal(shutdown.clone());
    let (server, _) = turnstile_shared::config::split_credentials(url);
    // Replies come to the observer's own inbox, which the operator's identity may read too.
    let (bare, opts) = turnstile_shared::config::options_or(url, "turnstile-dashboard", None);
    let client = opts
        .custom_inbox_prefix(turnstile_shared::subjects::api::inbox(
            turnstile_shared::permissions::OBSERVER_INBOX,
        ))
        .connect(turnstile_shared::config::seed_servers(&bare))
        .await
        .with_context(|| format!("connect to NATS at {bare}"))?;
    let failed = CancellationToken::new();
    let feed = feed::start(client.clone(), shutdown.clone(), failed.clone())
        .await
        .map_err(|e| anyhow::anyhow!("subscribe to the lifecycle events: {e}"))?;
    let listener = tokio::net::TcpListener::bind(args.addr)
        .await
        .with_context(|| format!("serve the dashboard on {}", args.addr))?;
    let local = listener.local_addr()?;
    // The first line on stdout says where the page is (scripts read it).
    println!("dashboard: http://{local}/ (NATS {server})");
    let mut hosts = vec![
        local.to_string(),
        format!("localhost:{}", local.port()),
        format!("127.0.0.1:{}", local.port()),
        format!("[::1]:{}", local.port()),
    ];
    hosts.extend(args.allow_hosts.iter().cloned());
    let state = Arc::new(http::State {
        client,
        server,
        feed,
        hosts,
        limits: snapshot::Limits {
            sessions: args.sessions,
            runs: args.runs,
            schedules: args.schedules,
        },
        shutdown: shutdown.clone(),
    });
    http::serve(listener, state).await;
    if failed.is_cancelled() {
        anyhow::bail!("the lifecycle event subscription ended");
    }
    Ok(ExitCode::SUCCESS)
}
