//! The dashboard's one read of the current state, taken when a page connects: hosts, sessions
//! (busy and queue depth off the lane, pending completions), recent runs with their execution
//! trees, and schedules with their next fire times and recent slots. Everything comes from the
//! services' read-only APIs (the observer identity may call them); after it, the page follows
//! lifecycle events only. What a service could not answer is listed in `errors`, and the rest
//! is still shown.

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use turnstile_shared::api::{self, HostView, ListHosts, ListSessions, SessionView};
use turnstile_shared::page::{Page, PageRequest};
use turnstile_shared::runs::RunRecord;
use turnstile_shared::schedules::{
    ListRuns, ListSchedules, ScheduleRecord, ScheduleRef, ScheduleView,
};
use turnstile_shared::step_api::{ExecRef, TreeNode};
use turnstile_shared::subjects::api as subj;

/// How long one API call of a snapshot may take.
const CALL: Duration = Duration::from_secs(10);

/// How much one snapshot reads.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub sessions: u32,
    pub runs: u32,
    pub schedules: u32,
}

/// A run and its execution tree (run → messages → turns → steps).
#[derive(Debug, Serialize)]
pub struct RunView {
    pub run: RunRecord,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tree: Option<TreeNode>,
}

#[derive(Debug, Serialize)]
pub struct Snapshot {
    pub taken_at: chrono::DateTime<chrono::Utc>,
    /// The NATS server, without credentials.
    pub server: String,
    pub hosts: Vec<HostView>,
    pub sessions: Vec<SessionView>,
    /// Newest first.
    pub runs: Vec<RunView>,
    pub schedules: Vec<ScheduleView>,
    /// What could not be read, in words: shown on the page.
    pub errors: Vec<String>,
    /// How many runs the page keeps (the newest).
    pub runs_shown: u32,
}

/// Reads the state through the APIs; a failed read becomes an entry of `errors`.
pub async fn take(client: &async_nats::Client, server: &str, limits: Limits) -> Snapshot {
    let mut errors = Vec::new();
    let list = ListSessions {
        page: first(limits.sessions),
    };
    let (hosts, sessions, runs, schedules) = tokio::join!(
        api::call::<_, Vec<HostView>>(client, subj::SESSION_HOSTS, &ListHosts {}, CALL),
        api::call::<_, Page<SessionView>>(client, subj::SESSION_LIST, &list, CALL),
        runs(client, limits.runs),
        schedules(client, limits.schedules),
    );
    let hosts = kept(hosts.map(|h| (h, Vec::new())), "hosts", &mut errors);
    let sessions = kept(
        sessions.map(|p| (p.items, Vec::new())),
        "sessions",
        &mut errors,
    );
    let runs = kept(runs, "runs", &mut errors);
    let schedules = kept(schedules, "schedules", &mut errors);
    Snapshot {
        taken_at: chrono::Utc::now(),
        server: server.to_string(),
        hosts,
        sessions,
        runs,
        schedules,
        errors,
        runs_shown: limits.runs,
    }
}

/// What a read gave, its partial failures and its failure noted in `errors` (an empty list
/// when it failed).
fn kept<T>(
    read: Result<(Vec<T>, Vec<String>), api::ApiError>,
    what: &str,
    errors: &mut Vec<String>,
) -> Vec<T> {
    match read {
        Ok((items, failed)) => {
            errors.extend(failed);
            items
        }
        Err(e) => {
            errors.push(format!("{what}: {e}"));
            Vec::new()
        }
    }
}

fn first(limit: u32) -> PageRequest {
    PageRequest {
        limit: Some(limit),
        after: None,
    }
}

/// The newest runs, each with its tree (read concurrently), and the trees that could not be
/// read.
async fn runs(
    client: &async_nats::Client,
    limit: u32,
) -> Result<(Vec<RunView>, Vec<String>), api::ApiError> {
    let page: Page<RunRecord> = api::call(
        client,
        subj::RUNS_LIST,
        &ListRuns {
            schedule: None,
            page: first(limit),
        },
        CALL,
    )
    .await?;
    let subject = subj::exec(subj::OPERATOR, subj::TREE);
    let trees = futures::future::join_all(page.items.iter().map(|r| {
        let req = ExecRef { id: (&r.id).into() };
        let subject = subject.clone();
        async move { api::call::<_, TreeNode>(client, &subject, &req, CALL).await }
    }))
    .await;
    let mut failed = Vec::new();
    let runs = page
        .items
        .into_iter()
        .zip(trees)
        .map(|(run, tree)| {
            let tree = tree
                .map_err(|e| failed.push(format!("the tree of {}: {e}", run.id)))
                .ok();
            RunView { run, tree }
        })
        .collect();
    Ok((runs, failed))
}

/// The schedules, each with its next fire times and recent slots (a schedule whose view
/// could not be read is shown without them, and the failure said).
async fn schedules(
    client: &async_nats::Client,
    limit: u32,
) -> Result<(Vec<ScheduleView>, Vec<String>), api::ApiError> {
    let page: Page<ScheduleRecord> = api::call(
        client,
        subj::SCHEDULES_LIST,
        &ListSchedules { page: first(limit) },
        CALL,
    )
    .await?;
    let views =
        futures::future::join_all(
            page.items.iter().map(|s| {
                let req = ScheduleRef {
                    name: s.spec.name.clone(),
                };
                async move {
                    api::call::<_, ScheduleView>(client, subj::SCHEDULES_SHOW, &req, CALL).await
                }
            }),
        )
        .await;
    let mut failed = Vec::new();
    let views = page
        .items
        .into_iter()
        .zip(views)
        .map(|(schedule, view)| {
            view.unwrap_or_else(|e| {
                failed.push(format!("schedule {}: {e}", schedule.spec.name));
                ScheduleView {
                    schedule,
                    next: Vec::new(),
                    slots: Vec::new(),
                }
            })
        })
        .collect();
    Ok((views, failed))
}

/// Fields the page never shows, removed at any depth before anything is sent: secrets
/// (`token`, whatever a record carries now or later), and what agents were told or printed
/// (a step's `work` with its command, input or prompt; a session's `launch`; a run's
/// `messages` and `finalizer`; turn `text`, step `result` and `output`), which the page has
/// no use for.
const NOT_SENT: [&str; 9] = [
    "token",
    "work",
    "launch",
    "messages",
    "finalizer",
    "text",
    "result",
    "output",
    "in_flight",
];

pub fn redact(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for key in NOT_SENT {
                map.remove(key);
            }
            map.values_mut().for_each(redact);
        }
        Value::Array(items) => items.iter_mut().for_each(redact),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_removed_at_any_depth() {
        let mut v = serde_json::json!({
            "token": "a",
            "session": {"token": "b", "name": "n"},
            "nodes": [{"record": {"token": "c", "id": "stp_1"}}]
        });
        redact(&mut v);
        let text = v.to_string();
        assert!(!text.contains("token"), "{text}");
        assert!(text.contains("stp_1") && text.contains("\"n\""), "{text}");
    }
}
