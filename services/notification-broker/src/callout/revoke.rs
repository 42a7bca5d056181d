//! Ends a stopped session's live connections. A new connection with its token is refused by
//! the callout at once; one opened before the stop would otherwise live until its credential
//! expires. With a system-account identity, every broker replica that sees `session.stopped`
//! asks every server for that session's connections (`$SYS.REQ.SERVER.PING.CONNZ`) and ends
//! each (`$SYS.REQ.SERVER.<id>.KICK`); replicas doing it twice is harmless.

use std::time::Duration;

use futures::StreamExt;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use turnstile_shared::events::EventKind;
use turnstile_shared::subjects::{self, api as subj};

use super::error::CalloutError;
use crate::ctx::Ctx;

/// How long to gather the servers' answers: each server answers once, at once.
const GATHER_QUIET: Duration = Duration::from_millis(250);
const GATHER_MAX: Duration = Duration::from_secs(2);
const KICK_TIMEOUT: Duration = Duration::from_secs(2);

pub(super) struct Revoker {
    task: tokio::task::JoinHandle<()>,
}

impl Revoker {
    /// Follows session stops and revokes, if a system identity is configured.
    pub(super) async fn start(
        ctx: &Ctx,
        system_url: Option<&str>,
        shutdown: &CancellationToken,
    ) -> Result<Option<Self>, CalloutError> {
        let Some(url) = system_url else {
            tracing::warn!(
                "no system-account identity (--system-nats): a stopped session's open \
                 connections end only when their credentials expire"
            );
            return Ok(None);
        };
        let sys = turnstile_shared::config::connect_once(url, "turnstile-revoker").await?;
        let subject = subjects::session_event("*", EventKind::SessionStopped.as_str());
        let mut stops =
            ctx.client
                .subscribe(subject)
                .await
                .map_err(|source| CalloutError::Subscribe {
                    subject: "the session stop events",
                    source,
                })?;
        let shutdown = shutdown.clone();
        let task = tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break,
                    m = stops.next() => match m { Some(m) => m, None => break },
                };
                // ts.events.session.<id>.session.stopped
                let Some(session) = msg.subject.split('.').nth(3).map(str::to_string) else {
                    continue;
                };
                let sys = sys.clone();
                tokio::spawn(async move {
                    match revoke(&sys, &session).await {
                        Ok(0) => {}
                        Ok(n) => {
                            tracing::info!(%session, connections = n, "stopped session's connections ended")
                        }
                        Err(e) => {
                            tracing::warn!(%session, error = %e, "end a stopped session's connections")
                        }
                    }
                });
            }
            let _ = sys.drain().await;
        });
        Ok(Some(Self { task }))
    }

    pub(super) async fn stop(self) {
        let _ = self.task.await;
    }
}

#[derive(Debug, thiserror::Error)]
pub(super) enum RevokeError {
    #[error("ask the servers for {user}'s connections: {source}")]
    Connz {
        user: String,
        source: async_nats::Error,
    },
}

#[derive(Deserialize)]
struct ServerReply {
    server: ServerInfo,
    #[serde(default)]
    data: Option<Connz>,
}

#[derive(Deserialize)]
struct ServerInfo {
    id: String,
}

#[derive(Deserialize)]
struct Connz {
    #[serde(default)]
    connections: Vec<Conn>,
}

#[derive(Deserialize)]
struct Conn {
    cid: u64,
}

/// Ends every connection of `user` on every server; returns how many it ended.
pub(super) async fn revoke(sys: &async_nats::Client, user: &str) -> Result<usize, RevokeError> {
    let err = |source: async_nats::Error| RevokeError::Connz {
        user: user.to_string(),
        source,
    };
    let inbox = sys.new_inbox();
    let mut answers = sys
        .subscribe(inbox.clone())
        .await
        .map_err(|e| err(e.into()))?;
    let query = serde_json::json!({ "user": user, "limit": 1024 });
    sys.publish_with_reply(subj::SERVER_CONNZ, inbox, query.to_string().into())
        .await
        .map_err(|e| err(e.into()))?;
    let mut found = Vec::new();
    let until = tokio::time::Instant::now() + GATHER_MAX;
    loop {
        let quiet = tokio::time::sleep(GATHER_QUIET);
        let next = tokio::select! {
            m = answers.next() => m,
            _ = quiet => None,
            _ = tokio::time::sleep_until(until) => None,
        };
        let Some(msg) = next else { break };
        match serde_json::from_slice::<ServerReply>(&msg.payload) {
            Ok(r) => {
                for c in r.data.map(|d| d.connections).unwrap_or_default() {
                    found.push((r.server.id.clone(), c.cid));
                }
            }
            Err(e) => tracing::warn!(error = %e, "unreadable connz answer"),
        }
    }
    let mut ended = 0;
    for (server, cid) in found {
        let body = serde_json::json!({ "cid": cid }).to_string();
        let kick = sys.request(subj::server_kick(&server), body.into());
        match tokio::time::timeout(KICK_TIMEOUT, kick).await {
            Ok(Ok(_)) => ended += 1,
            Ok(Err(e)) => tracing::warn!(%server, cid, error = %e, "kick"),
            Err(_) => tracing::warn!(%server, cid, "kick: no answer"),
        }
    }
    Ok(ended)
}
