//! Notices an agent whose process exits while its session is idle, without waiting for the
//! next turn (R9): the panes on this host's private tmux server are checked twice a
//! second, and a newly dead one is reported as `terminal.died` with the evidence (host,
//! terminal, exit status, last lines). The next turn resumes the same conversation once; a
//! turn is never typed into the dead process.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::SessionId;

use crate::ctx::Ctx;
use crate::tmux::Tmux;

const EVERY: Duration = Duration::from_millis(500);
const EVIDENCE_LINES: usize = 20;

pub(crate) async fn run(ctx: Arc<Ctx>, tmux: Tmux, shutdown: CancellationToken) {
    let mut reported: HashSet<String> = HashSet::new();
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let panes = tmux.panes().await;
        reported.retain(|name| panes.iter().any(|(n, dead, _)| n == name && *dead));
        for (name, dead, status) in panes {
            if !dead || reported.contains(&name) {
                continue;
            }
            let Ok(session) = name.parse::<SessionId>() else {
                continue;
            };
            reported.insert(name.clone());
            report(&ctx, &tmux, &session, &name, status).await;
        }
    }
}

async fn report(ctx: &Ctx, tmux: &Tmux, session: &SessionId, name: &str, status: Option<i32>) {
    let last_lines = match tmux.pane_state(name).await {
        Ok(state) => state.last_lines(EVIDENCE_LINES),
        Err(_) => Vec::new(),
    };
    tracing::warn!(%session, status = ?status, "agent exited while idle");
    turnstile_shared::metrics::metrics().terminals_died.inc();
    let data = json!({
        "host": ctx.config.host,
        "terminal": name,
        "exit_status": status,
        "last_lines": last_lines,
        "next": "the next turn resumes the same conversation once (R9)",
    });
    let ev = session_event(EventKind::TerminalDied, session, None, &data).map(|e| {
        e.with_id(format!(
            "{session}:terminal.died:{}",
            uuid::Uuid::now_v7().simple()
        ))
    });
    match ev {
        Ok(ev) => {
            if let Err(e) = events::publish(&ctx.js, &ev).await {
                tracing::warn!(%session, error = %e, "terminal.died event");
            }
        }
        Err(e) => tracing::warn!(error = %e, "build terminal.died"),
    }
}
