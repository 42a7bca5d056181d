//! The `step.<status>` session events. The step API (queued, running), the end recorder
//! (completed, failed, cancelled) and the background agents (running) all announce steps the
//! same way, so the event is built in one place under them.

use serde_json::json;
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::execution::ExecutionRecord;

use crate::ctx::Ctx;

/// `step.<status>` on the session the step belongs to, de-duplicated per (step, status).
pub(crate) async fn step_event(ctx: &Ctx, record: &ExecutionRecord, k: EventKind) {
    match step_envelope(record, k) {
        Ok(ev) => {
            if let Err(e) = events::publish(&ctx.js, &ev).await {
                tracing::warn!(execution = %record.id, error = %e, "step event");
            }
        }
        Err(e) => tracing::warn!(execution = %record.id, error = %e, "build step event"),
    }
}

/// The `step.<status>` envelope, its id `<execution>:<kind>` so a re-publish is de-duplicated.
pub(crate) fn step_envelope(
    record: &ExecutionRecord,
    k: EventKind,
) -> Result<turnstile_shared::Envelope, turnstile_shared::EnvelopeError> {
    let data = json!({
        "execution": record.id,
        "name": record.name,
        "parent": record.parent,
        "scope": record.scope,
        "owner": record.owner,
        "watchers": record.watchers,
        "status": record.status,
    });
    session_event(k, &record.session, None, &data).map(|e| e.with_id(format!("{}:{k}", record.id)))
}
