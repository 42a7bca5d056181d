//! Where a lane hand-off's time goes, read after the turns ran (nothing added to the timed
//! path): the transport's stamps on the turn records and the server's store times of the
//! lane's events on the session's event stream. For turn i ending and turn i+1 starting:
//! - `end_to_outcome_event`: turn i's `ended_at` (the transport's stamp, before it writes the
//!   record) to its outcome event stored: the record's write, the lane's wake on it, the
//!   event's publish (sent beside the lane item's ack).
//! - `outcome_event_to_next_started`: that event stored to turn i+1's `turn.started` stored:
//!   the ack taken, the next item delivered to the lane, admitted and dispatched.
//! - `next_started_to_typed`: `turn.started` stored to turn i+1's `typed_at`: the transport
//!   command (sent right behind the event) stored and delivered, and the transport's work up
//!   to typing.
//!
//! All clocks are this machine's (server and transport run here), in microseconds.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result};
use async_nats::jetstream::consumer::{pull, DeliverPolicy};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::EventKind;
use turnstile_shared::records::{TurnRecord, TurnState};
use turnstile_shared::subjects;
use turnstile_shared::{SessionId, TurnId};

/// The p50 of each stage over consecutive completed turns (the first `skip` hand-offs left
/// out, as the hand-off figure leaves them out).
pub async fn measure(
    js: &async_nats::jetstream::Context,
    session: &SessionId,
    records: &[TurnRecord],
    skip: usize,
) -> Result<serde_json::Value> {
    let stored = event_times(js, session).await?;
    let mut spans: Vec<_> = records
        .iter()
        .filter_map(|r| match &r.state {
            TurnState::Completed {
                typed_at, ended_at, ..
            } => Some((r.id.clone(), *typed_at, *ended_at)),
            _ => None,
        })
        .collect();
    spans.sort_by_key(|(_, typed, _)| *typed);
    let (mut to_event, mut to_next, mut to_typed) = (Vec::new(), Vec::new(), Vec::new());
    for w in spans.windows(2).skip(skip) {
        let ((this, _, ended), (next, typed, _)) = (&w[0], &w[1]);
        let (Some(outcome), Some(started)) = (
            stored.get(&(this.clone(), Stage::Outcome)),
            stored.get(&(next.clone(), Stage::Started)),
        ) else {
            continue;
        };
        to_event.push(us(*outcome - *ended));
        to_next.push(us(*started - *outcome));
        to_typed.push(us(*typed - *started));
    }
    Ok(serde_json::json!({
        "hand_offs": to_event.len(),
        "end_to_outcome_event": crate::stats::summary(to_event)["p50_us"],
        "outcome_event_to_next_started": crate::stats::summary(to_next)["p50_us"],
        "next_started_to_typed": crate::stats::summary(to_typed)["p50_us"],
    }))
}

fn us(d: chrono::TimeDelta) -> f64 {
    d.num_microseconds().unwrap_or_default() as f64
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Stage {
    Started,
    Outcome,
}

/// The server's store time of each `turn.started` and outcome event of `session`.
async fn event_times(
    js: &async_nats::jetstream::Context,
    session: &SessionId,
) -> Result<HashMap<(TurnId, Stage), DateTime<Utc>>> {
    let stream = js.get_stream(subjects::EVENTS_STREAM).await?;
    let consumer = stream
        .create_consumer(pull::OrderedConfig {
            filter_subject: subjects::session_events(session),
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut out = HashMap::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .context("the session's events did not arrive")?
            .context("the event stream ended")?
            .map_err(|e| anyhow::anyhow!("read events: {e}"))?;
        let info = msg.info().map_err(|e| anyhow::anyhow!("event info: {e}"))?;
        let pending = info.pending;
        let at = DateTime::<Utc>::from_timestamp_nanos(
            i64::try_from(info.published.unix_timestamp_nanos()).unwrap_or_default(),
        );
        if let Ok(env) = Envelope::decode(&msg.payload) {
            let stage = match env.kind.parse::<EventKind>() {
                Ok(EventKind::TurnStarted) => Some(Stage::Started),
                Ok(EventKind::TurnCompleted) => Some(Stage::Outcome),
                _ => None,
            };
            if let (Some(stage), Some(turn)) = (stage, env.turn) {
                out.entry((turn, stage)).or_insert(at);
            }
        }
        if pending == 0 {
            return Ok(out);
        }
    }
}
