//! A fake `codex` CLI for the `codex` adapter's tests: `codex exec --json [resume <thread>]
//! <prompt>` prints the JSON-lines events of one turn (`thread.started`, `turn.started`,
//! `item.completed`, `turn.completed` or `turn.failed`), keeps each thread in
//! `$FAKE_CODEX_STATE/<thread_id>.jsonl`, and fails like the real CLI: an unknown thread,
//! `!crash` (dies mid-turn) and `!fail` (`turn.failed`).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::json;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) != Some("exec") || !args.iter().any(|a| a == "--json") {
        eprintln!("usage: codex exec --json [resume <thread_id>] <prompt>");
        return ExitCode::from(2);
    }
    let rest: Vec<&String> = args[1..].iter().filter(|a| *a != "--json").collect();
    let (thread, prompt) = match rest.as_slice() {
        [r, id, prompt] if r.as_str() == "resume" => (Some(id.to_string()), prompt.to_string()),
        [prompt] => (None, prompt.to_string()),
        _ => {
            eprintln!("usage: codex exec --json [resume <thread_id>] <prompt>");
            return ExitCode::from(2);
        }
    };
    let state = std::env::var_os("FAKE_CODEX_STATE")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("fake-codex"));
    let _ = std::fs::create_dir_all(&state);
    let thread = match thread {
        Some(id) if state.join(format!("{id}.jsonl")).exists() => id,
        Some(id) => {
            println!(
                "{}",
                json!({"type": "error", "message": format!("thread {id} not found")})
            );
            eprintln!("Error: thread {id} not found");
            return ExitCode::from(1);
        }
        None => format!(
            "th{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        ),
    };
    let emit = |v: serde_json::Value| {
        println!("{v}");
        let _ = std::io::stdout().flush();
    };
    emit(json!({"type": "thread.started", "thread_id": thread}));
    emit(json!({"type": "turn.started"}));
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(state.join(format!("{thread}.jsonl")))
    {
        let _ = writeln!(f, "{}", json!({ "message": prompt }));
    }
    if prompt.contains("!crash") {
        eprintln!("fatal: crashed on purpose");
        return ExitCode::from(3);
    }
    if prompt.contains("!fail") {
        emit(json!({"type": "turn.failed", "error": {"message": "the model refused"}}));
        return ExitCode::from(1);
    }
    let reply = format!("ok: {}", prompt.lines().next().unwrap_or_default());
    emit(
        json!({"type": "item.completed", "item": {"id": "item_0", "type": "agent_message", "text": reply}}),
    );
    emit(json!({"type": "turn.completed", "usage": {"input_tokens": 1, "output_tokens": 1}}));
    ExitCode::SUCCESS
}
