//! A fake `claude` CLI for the `claude` adapter's tests: it speaks Claude Code's headless
//! stream-json protocol (`system/init`, `assistant`, `result` lines; user messages in), keeps
//! each conversation in `$FAKE_CLAUDE_STATE/<session_id>.jsonl`, resumes one with `--resume`,
//! and fails like the real CLI does: an unknown `--resume` id, a missing flag, `!crash` (the
//! process dies mid-turn) and `!fail` (an error result).

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::{json, Value};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    for required in ["-p", "--verbose"] {
        if !args.iter().any(|a| a == required) {
            eprintln!("Error: {required} is required in this mode");
            return ExitCode::from(1);
        }
    }
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    if value("--input-format").as_deref() != Some("stream-json")
        || value("--output-format").as_deref() != Some("stream-json")
    {
        eprintln!("Error: --input-format=stream-json requires --output-format=stream-json");
        return ExitCode::from(1);
    }
    let mcp_ok = value("--mcp-config")
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .is_some_and(|v| v.pointer("/mcpServers/turnstile/command").is_some());
    if !mcp_ok {
        eprintln!("Error: invalid MCP configuration");
        return ExitCode::from(1);
    }
    let state = std::env::var_os("FAKE_CLAUDE_STATE")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("fake-claude"));
    let _ = std::fs::create_dir_all(&state);
    let session = match value("--resume") {
        Some(id) => {
            if !state.join(format!("{id}.jsonl")).exists() {
                eprintln!("No conversation found with session ID: {id}");
                return ExitCode::from(1);
            }
            id
        }
        None => format!(
            "fc{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        ),
    };
    let out = std::io::stdout();
    let mut out = out.lock();
    let mut emit = |v: Value| {
        let _ = writeln!(out, "{v}");
        let _ = out.flush();
    };
    let mut first = true;
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            eprintln!("Error: could not parse input line");
            continue;
        };
        let text = msg
            .pointer("/message/content/0/text")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if first {
            emit(
                json!({"type": "system", "subtype": "init", "session_id": session,
                        "mcp_servers": [{"name": "turnstile", "status": "connected"}]}),
            );
            first = false;
        }
        let record = json!({ "message": text });
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(state.join(format!("{session}.jsonl")))
        {
            let _ = writeln!(f, "{record}");
        }
        let reply = format!("ok: {}", text.lines().next().unwrap_or_default());
        emit(json!({"type": "assistant", "session_id": session,
                    "message": {"role": "assistant", "content": [{"type": "text", "text": "working on it"}]}}));
        if text.contains("!crash") {
            eprintln!("fatal: crashed on purpose");
            return ExitCode::from(2);
        }
        if text.contains("!fail") {
            emit(
                json!({"type": "result", "subtype": "error_during_execution", "is_error": true,
                        "session_id": session}),
            );
            continue;
        }
        emit(
            json!({"type": "result", "subtype": "success", "is_error": false,
                    "result": reply, "session_id": session}),
        );
    }
    ExitCode::SUCCESS
}
