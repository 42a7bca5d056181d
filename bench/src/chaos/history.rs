//! What a campaign leaves behind, as the checker reads it: every session, turn, execution, run
//! and slot record, the messages each mock agent was typed (its conversation transcript), and
//! how many times each step's command started (the workload's step commands log each start).
//! Read once the faults have stopped and the stack went quiet; the checker only looks.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use turnstile_shared::execution::ExecutionRecord;
use turnstile_shared::records::{SessionRecord, TurnRecord};
use turnstile_shared::runs::RunRecord;
use turnstile_shared::schedules::SlotRecord;
use turnstile_shared::{subjects, ExecutionId, RunId, SessionId, StepId, TurnId};

/// A schedule as the checker needs it: its name and cron.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ScheduleCron {
    pub name: String,
    pub cron: String,
    pub zone: String,
}

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct History {
    pub sessions: HashMap<SessionId, SessionRecord>,
    pub turns: HashMap<TurnId, TurnRecord>,
    pub executions: HashMap<ExecutionId, ExecutionRecord>,
    pub runs: HashMap<RunId, RunRecord>,
    pub schedules: Vec<ScheduleCron>,
    pub slots: Vec<SlotRecord>,
    /// The messages each mock agent was typed, in order (sessions of other agents absent).
    pub transcripts: HashMap<SessionId, Vec<String>>,
    /// How many times each step's command started (from the step start log).
    pub step_starts: HashMap<StepId, u32>,
}

impl History {
    /// Reads every bucket whole (a campaign's history is small), the mock agents'
    /// transcripts under `mock_dir` and the step start log at `step_log`.
    pub async fn load(
        js: &async_nats::jetstream::Context,
        mock_dir: &Path,
        step_log: &Path,
        schedules: Vec<ScheduleCron>,
    ) -> Result<Self> {
        // Read in the order records refer to each other, the referring one first (a slot to
        // its run, a run to its turns and children, an execution to its turn): when the stack
        // is still at work (liveness not reached) a record ended after its bucket was read is
        // simply absent, never found ended while what it names is not read yet (a run read
        // completed after its turns were read named turns "missing").
        let slots: Vec<SlotRecord> = values(js, subjects::SLOTS_BUCKET).await?;
        let runs: Vec<RunRecord> = values(js, subjects::RUNS_BUCKET).await?;
        let executions: Vec<ExecutionRecord> = values(js, subjects::EXECUTIONS_BUCKET).await?;
        let turns: Vec<TurnRecord> = values(js, subjects::TURNS_BUCKET).await?;
        let sessions: Vec<SessionRecord> = values(js, subjects::SESSIONS_BUCKET).await?;
        let mut transcripts = HashMap::new();
        for s in &sessions {
            if let Some(conv) = &s.conversation {
                let path = mock_dir.join(format!("{conv}.jsonl"));
                if let Ok(text) = std::fs::read_to_string(&path) {
                    transcripts.insert(s.id.clone(), transcript(&text)?);
                }
            }
        }
        Ok(Self {
            sessions: sessions.into_iter().map(|s| (s.id.clone(), s)).collect(),
            turns: turns.into_iter().map(|t| (t.id.clone(), t)).collect(),
            executions: executions.into_iter().map(|e| (e.id.clone(), e)).collect(),
            runs: runs.into_iter().map(|r| (r.id.clone(), r)).collect(),
            schedules,
            slots,
            transcripts,
            step_starts: step_starts(step_log)?,
        })
    }
}

/// The messages of a mock agent's conversation file (one JSON object a line).
fn transcript(text: &str) -> Result<Vec<String>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).context("transcript line")?;
            Ok(v["message"].as_str().unwrap_or_default().to_string())
        })
        .collect()
}

/// One step id a line, written by each step command as it starts.
fn step_starts(path: &Path) -> Result<HashMap<StepId, u32>> {
    let mut out = HashMap::new();
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
    };
    for line in text.lines() {
        if let Ok(step) = line.trim().parse::<StepId>() {
            *out.entry(step).or_default() += 1;
        }
    }
    Ok(out)
}

/// Every live value of a bucket, decoded (keys that do not decode are skipped: the
/// executions bucket also holds nothing else, but a foreign key must not stop the check).
async fn values<T: serde::de::DeserializeOwned>(
    js: &async_nats::jetstream::Context,
    bucket: &str,
) -> Result<Vec<T>> {
    use futures::StreamExt;
    let kv = js.get_key_value(bucket).await?;
    let mut keys = kv.keys().await?;
    let mut out = Vec::new();
    while let Some(key) = keys.next().await {
        let key = key?;
        if let Some(bytes) = kv.get(&key).await? {
            if let Ok(v) = serde_json::from_slice(&bytes) {
                out.push(v);
            }
        }
    }
    Ok(out)
}

/// The turn (or delivery turn) that started `execution`: the first turn up its parents.
pub(super) fn starting_turn(history: &History, execution: &ExecutionId) -> Option<TurnId> {
    let mut at = history.executions.get(execution)?.parent.clone();
    for _ in 0..64 {
        let id = at?;
        if let Some(turn) = id.as_turn() {
            return Some(turn);
        }
        at = history.executions.get(&id)?.parent.clone();
    }
    None
}
