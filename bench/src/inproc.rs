//! The services of a deployment run inside the benchmark process (the `turnstile dev` way),
//! against the benchmark's own nats-server, so only real hand-offs are timed.

use std::time::Duration;

use anyhow::{bail, Result};
use tokio_util::sync::CancellationToken;
use turnstile_shared::api::{self, CreateSession, ErrorCode};
use turnstile_shared::records::{AgentKind, SessionRecord};
use turnstile_shared::subjects::api as subj;
use turnstile_shared::SessionId;

/// A service running in this process until its token is cancelled.
pub struct Running {
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    pub async fn stop(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }
}

pub fn start_lane(url: &str) -> Running {
    let cancel = CancellationToken::new();
    let config = turnstile_session_lane::Config::new(url);
    let task = tokio::spawn({
        let cancel = cancel.clone();
        async move {
            if let Err(e) = turnstile_session_lane::run(config, cancel).await {
                eprintln!("session-lane: {e}");
            }
        }
    });
    Running { cancel, task }
}

pub fn start_transport(url: &str, dir: &std::path::Path) -> Result<Running> {
    let cancel = CancellationToken::new();
    let host = crate::deployment::HOST.parse()?;
    let config = turnstile_transport_agent::Config::new(url, host, dir.to_path_buf());
    let task = tokio::spawn({
        let cancel = cancel.clone();
        async move {
            if let Err(e) = turnstile_transport_agent::run(config, cancel).await {
                eprintln!("transport: {e}");
            }
        }
    });
    Ok(Running { cancel, task })
}

pub fn start_scheduler(url: &str) -> Running {
    let cancel = CancellationToken::new();
    let config = turnstile_scheduler::Config::new(url);
    let task = tokio::spawn({
        let cancel = cancel.clone();
        async move {
            if let Err(e) = turnstile_scheduler::run(config, cancel).await {
                eprintln!("scheduler: {e}");
            }
        }
    });
    Running { cancel, task }
}

pub fn start_broker(
    url: &str,
    callout: Option<turnstile_notification_broker::CalloutConfig>,
) -> Running {
    let cancel = CancellationToken::new();
    let mut config = turnstile_notification_broker::Config::new(url);
    config.callout = callout;
    let task = tokio::spawn({
        let cancel = cancel.clone();
        async move {
            if let Err(e) = turnstile_notification_broker::run(config, cancel).await {
                eprintln!("broker: {e}");
            }
        }
    });
    Running { cancel, task }
}

/// Creates `n` instant-agent sessions, [`CREATE_CONCURRENCY`] requests at a time, as an
/// operator's tooling would; in order of their names.
pub async fn create_sessions(client: &async_nats::Client, n: usize) -> Result<Vec<SessionId>> {
    use futures::{StreamExt, TryStreamExt};
    futures::stream::iter(0..n)
        .map(|i| create_session(client, i))
        .buffered(CREATE_CONCURRENCY)
        .try_collect()
        .await
}

/// Session creates in flight at once.
pub const CREATE_CONCURRENCY: usize = 32;

async fn create_session(client: &async_nats::Client, i: usize) -> Result<SessionId> {
    let req = CreateSession {
        agent: AgentKind::Instant,
        name: format!("bench-{i}"),
        host: None,
        cwd: None,
        id: Some(SessionId::new()),
        launch: None,
        ready_timeout_ms: None,
        policy: None,
    };
    let mut tries = 0;
    loop {
        match api::call::<_, SessionRecord>(
            client,
            subj::SESSION_CREATE,
            &req,
            Duration::from_secs(10),
        )
        .await
        {
            Ok(r) => return Ok(r.id),
            Err(e) if (e.code == ErrorCode::NoHost || e.code.is_transient()) && tries < 100 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => bail!("create session: {e}"),
        }
    }
}
