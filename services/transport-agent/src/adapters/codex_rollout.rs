//! Codex's own record of a thread, its rollout file (`$CODEX_HOME/sessions/<date>/
//! rollout-<time>-<thread>.jsonl`): the evidence of a command the sandbox refused when
//! `exec --json` printed no item for it. A command that ends in the same instant it starts
//! (`touch` on a read-only file system) often reaches the model without the `command_execution`
//! item ever being printed; the rollout always has the call and its output.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use turnstile_shared::ConversationId;

/// The rollout record that opens a turn.
const TASK_STARTED: &str = "task_started";

/// Where codex keeps its state: `CODEX_HOME`, else `~/.codex`.
pub(crate) fn codex_home() -> Option<PathBuf> {
    std::env::var_os("CODEX_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".codex")))
}

/// The rollout file of `thread`, searched for under `home/sessions`.
pub(crate) fn find(home: &Path, thread: &ConversationId) -> Option<PathBuf> {
    let suffix = format!("-{thread}.jsonl");
    let mut dirs = vec![home.join("sessions")];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("rollout-") && n.ends_with(&suffix))
            {
                return Some(path);
            }
        }
    }
    None
}

/// `<command>: <refusal>` for each command of the file's last turn (the records after its
/// last `task_started`: `codex exec` runs one turn per process) whose output shows one of
/// `refusals` and which did not exit 0.
pub(crate) fn refused(path: &Path, refusals: &[&str]) -> Vec<String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "read codex rollout");
            return Vec::new();
        }
    };
    let records: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let start = records
        .iter()
        .rposition(|r| r.pointer("/payload/type").and_then(Value::as_str) == Some(TASK_STARTED))
        .unwrap_or(0);
    let mut calls: HashMap<String, String> = HashMap::new();
    let mut out = Vec::new();
    for record in &records[start..] {
        let Some(payload) = record.get("payload") else {
            continue;
        };
        let call_id = payload.get("call_id").and_then(Value::as_str);
        match (payload.get("type").and_then(Value::as_str), call_id) {
            (Some("function_call"), Some(id)) => {
                calls.insert(id.to_string(), command_of(payload));
            }
            (Some("function_call_output"), Some(id)) => {
                let output = output_text(payload);
                let Some(hit) = refusals.iter().find(|r| output.contains(**r)) else {
                    continue;
                };
                if exit_code(&output) == Some(0) {
                    continue;
                }
                let command = calls.get(id).map_or("?", String::as_str);
                out.push(format!("{command}: {hit}"));
            }
            _ => {}
        }
    }
    out
}

/// The command a call ran: `cmd` (`exec_command`) or the `command` argv (`shell`).
fn command_of(call: &Value) -> String {
    let args: Value = call
        .get("arguments")
        .and_then(Value::as_str)
        .and_then(|a| serde_json::from_str(a).ok())
        .unwrap_or(Value::Null);
    if let Some(cmd) = args.get("cmd").and_then(Value::as_str) {
        return cmd.to_string();
    }
    match args.get("command") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(argv)) => argv
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" "),
        _ => "?".to_string(),
    }
}

/// A call's output as text, whether recorded as a string or as `{"content": …}`.
fn output_text(out: &Value) -> String {
    match out.get("output") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => String::new(),
    }
}

/// The exit code an output reports (`Process exited with code N`, or `"exit_code": N`).
fn exit_code(output: &str) -> Option<i64> {
    let after = |marker: &str| {
        output.find(marker).and_then(|i| {
            output[i + marker.len()..]
                .trim_start()
                .split(|c: char| !c.is_ascii_digit() && c != '-')
                .next()
                .and_then(|n| n.parse().ok())
        })
    };
    after("exited with code").or_else(|| after("\"exit_code\":"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_call_is_found_with_its_command_and_a_clean_one_is_not() {
        let path = std::env::temp_dir().join(format!("ts-rollout-{}.jsonl", uuid::Uuid::new_v4()));
        let lines = [
            r#"{"type":"event_msg","payload":{"type":"task_started"}}"#,
            r#"{"type":"response_item","payload":{"type":"function_call","name":"exec_command","arguments":"{\"cmd\":\"touch refused.txt\"}","call_id":"c1"}}"#,
            r#"{"type":"response_item","payload":{"type":"function_call_output","call_id":"c1","output":"Process exited with code 1\nOutput:\ntouch: cannot touch 'refused.txt': Read-only file system\n"}}"#,
            r#"{"type":"response_item","payload":{"type":"function_call","name":"shell","arguments":"{\"command\":[\"bash\",\"-lc\",\"cat notes\"]}","call_id":"c2"}}"#,
            r#"{"type":"response_item","payload":{"type":"function_call_output","call_id":"c2","output":"Process exited with code 0\nOutput:\nRead-only file system is fine here\n"}}"#,
        ];
        std::fs::write(&path, lines.join("\n")).expect("write");
        let found = refused(&path, &["Read-only file system"]);
        assert_eq!(found, vec!["touch refused.txt: Read-only file system"]);
        // Only the last turn counts: a later turn without a refusal finds none.
        let mut later = lines.to_vec();
        later.push(lines[0]);
        std::fs::write(&path, later.join("\n")).expect("write");
        assert!(refused(&path, &["Read-only file system"]).is_empty());
        assert_eq!(exit_code("\"exit_code\": 2"), Some(2));
        let _ = std::fs::remove_file(&path);
    }
}
