//! A run's lifecycle events (`run.started`, `run.round`, `run.completed`, `run.failed`), each
//! de-duplicated by the run and its attempt (and, for a round, its turn), so a resumed run
//! never shows one twice and a retried one shows its new attempt.

use serde_json::json;
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::runs::RunRecord;

use crate::ctx::Ctx;

pub(crate) async fn event(ctx: &Ctx, run: &RunRecord, k: EventKind, data: serde_json::Value) {
    let mut data = data;
    data["run"] = json!(run.id);
    let ev = session_event(k, &run.session, None, &data).map(|e| {
        let id = match k {
            EventKind::RunRound => {
                format!("{}:{k}:{}", run.id, data["turn"].as_str().unwrap_or(""))
            }
            // A retried run's attempt starts and ends again: its events are new ones.
            _ if run.attempt > 0 => format!("{}:{k}:a{}", run.id, run.attempt),
            _ => format!("{}:{k}", run.id),
        };
        e.with_id(id)
    });
    match ev {
        Ok(ev) => {
            if let Err(e) = events::publish(&ctx.js, &ev).await {
                tracing::warn!(run = %run.id, error = %e, "run event");
            }
        }
        Err(e) => tracing::warn!(run = %run.id, error = %e, "build run event"),
    }
}
