//! `turnstile mcp`: an MCP server over stdio (newline-delimited JSON-RPC 2.0), so a coding agent
//! can start and inspect steps through tools instead of shelling out to `turnstile step`.

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, OnceCell};
use turnstile_shared::execution::{ExecutionRecord, Scope};
use turnstile_shared::step_api::{Caller, ListSteps, StartStep, StepKind, StepStatus};
use turnstile_shared::subjects::api as subj;
use turnstile_shared::StepId;

const API_TIMEOUT: Duration = Duration::from_secs(10);
const LATEST: &str = "2025-06-18";
const VERSIONS: [&str; 3] = ["2025-06-18", "2025-03-26", "2024-11-05"];
const NO_CREDENTIALS: &str = "turnstile mcp has no credentials: its environment needs \
    TURNSTILE_SESSION and TURNSTILE_TOKEN (set in a Turnstile agent's terminal), or \
    TURNSTILE_STEP and TURNSTILE_STEP_TOKEN (set in a step's process). Launch the MCP server \
    from that environment or pass them in its MCP config.";
const INSTRUCTIONS: &str = "Turnstile runs work as steps beside this conversation. start_step \
    returns at once; the step's result is delivered to this conversation as a new message when \
    it ends, so do not poll for it. Use step_status or list_steps only to inspect.";

/// The broker's request/reply API; a trait so the protocol is tested without NATS.
trait Backend: Send + Sync + 'static {
    fn call(&self, subject: &'static str, request: Value) -> BoxFuture<'_, Result<Value, String>>;
}

/// Connects on the first tool call (and again after a failed attempt), so the server answers
/// `initialize` at once even when NATS is down.
struct Nats {
    url: String,
    client: OnceCell<async_nats::Client>,
}

impl Backend for Nats {
    fn call(&self, subject: &'static str, request: Value) -> BoxFuture<'_, Result<Value, String>> {
        Box::pin(async move {
            let client = self
                .client
                .get_or_try_init(|| {
                    turnstile_shared::config::connect_once(&self.url, "turnstile-mcp")
                })
                .await
                .map_err(|e| {
                    format!("{e} (is Turnstile running? set --nats or TURNSTILE_NATS_URL)")
                })?;
            turnstile_shared::api::call::<Value, Value>(client, subject, &request, API_TIMEOUT)
                .await
                .map_err(|e| e.to_string())
        })
    }
}

pub async fn run(url: &str) -> anyhow::Result<ExitCode> {
    let caller = Caller::from_env().filter(|c| c.session.is_some() || c.step.is_some());
    if caller.is_none() {
        eprintln!("{NO_CREDENTIALS}");
    }
    let nats = Nats {
        url: url.to_string(),
        client: OnceCell::new(),
    };
    let server = Arc::new(Server::new(caller, nats));

    // stdout has one writer, so replies never interleave; each line is flushed.
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Value>();
    let writer = tokio::task::spawn_blocking(move || {
        let mut stdout = std::io::stdout().lock();
        while let Some(msg) = out_rx.blocking_recv() {
            let written = serde_json::to_writer(&mut stdout, &msg)
                .map_err(std::io::Error::from)
                .and_then(|()| stdout.write_all(b"\n"))
                .and_then(|()| stdout.flush());
            if let Err(e) = written {
                eprintln!("turnstile mcp: write stdout: {e}");
                return;
            }
        }
    });

    // A plain thread reads stdin (blocking), so a slow tool call never stops the reading.
    let (in_tx, mut in_rx) = mpsc::channel::<Vec<u8>>(64);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        loop {
            let mut line = Vec::new();
            match stdin.read_until(b'\n', &mut line) {
                Ok(0) => return,
                Ok(_) if in_tx.blocking_send(line).is_err() => return,
                Ok(_) => {}
                Err(e) => {
                    eprintln!("turnstile mcp: read stdin: {e}");
                    return;
                }
            }
        }
    });

    let mut tasks = tokio::task::JoinSet::new();
    while let Some(bytes) = in_rx.recv().await {
        let (server, out) = (server.clone(), out_tx.clone());
        tasks.spawn(async move {
            let reply = match std::str::from_utf8(&bytes) {
                Ok(line) => server.handle_message(line).await,
                Err(_) => Some(rpc_error(Value::Null, -32700, "parse error: not UTF-8")),
            };
            if let Some(reply) = reply {
                let _ = out.send(reply);
            }
        });
        while tasks.try_join_next().is_some() {}
    }
    // EOF: let calls in flight answer, then close stdout's writer.
    while tasks.join_next().await.is_some() {}
    drop(out_tx);
    let _ = writer.await;
    Ok(ExitCode::SUCCESS)
}

fn rpc_error(id: Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

fn tool_result(text: String, is_error: bool) -> Value {
    json!({"content": [{"type": "text", "text": text}], "isError": is_error})
}

struct Server<B> {
    caller: Option<Caller>,
    backend: B,
}

impl<B: Backend> Server<B> {
    fn new(caller: Option<Caller>, backend: B) -> Self {
        Self { caller, backend }
    }

    /// One line from stdin; the reply to write, or `None` for notifications and blank lines.
    async fn handle_message(&self, line: &str) -> Option<Value> {
        if line.trim().is_empty() {
            return None;
        }
        let msg: Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => return Some(rpc_error(Value::Null, -32700, &format!("parse error: {e}"))),
        };
        let Value::Object(msg) = msg else {
            return Some(rpc_error(
                Value::Null,
                -32600,
                "invalid request: batches and non-objects are not supported",
            ));
        };
        let id = msg.get("id").cloned();
        if id
            .as_ref()
            .is_some_and(|id| !(id.is_string() || id.is_number()))
        {
            return Some(rpc_error(
                Value::Null,
                -32600,
                "invalid request: id must be a string or number",
            ));
        }
        let Some(method) = msg.get("method").and_then(Value::as_str) else {
            if msg.contains_key("result") || msg.contains_key("error") {
                return None; // a reply from the client; this server never sends requests
            }
            return Some(rpc_error(
                id.unwrap_or(Value::Null),
                -32600,
                "invalid request: no method",
            ));
        };
        if msg.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
            return id.map(|id| rpc_error(id, -32600, "invalid request: jsonrpc must be \"2.0\""));
        }
        let id = id?; // a notification: never answered
        let params = msg.get("params").cloned().unwrap_or(Value::Null);
        Some(match self.request(method, &params).await {
            Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
            Err((code, message)) => rpc_error(id, code, &message),
        })
    }

    async fn request(&self, method: &str, params: &Value) -> Result<Value, (i64, String)> {
        match method {
            "initialize" => {
                let asked = params.get("protocolVersion").and_then(Value::as_str);
                let version = asked.filter(|v| VERSIONS.contains(v)).unwrap_or(LATEST);
                Ok(json!({
                    "protocolVersion": version,
                    "capabilities": {"tools": {"listChanged": false}},
                    "serverInfo": {"name": "turnstile", "version": env!("CARGO_PKG_VERSION")},
                    "instructions": INSTRUCTIONS,
                }))
            }
            "ping" => Ok(json!({})),
            "tools/list" => Ok(json!({"tools": tools()})),
            "tools/call" => {
                let Some(name) = params.get("name").and_then(Value::as_str) else {
                    return Err((
                        -32602,
                        "invalid params: tools/call needs a tool name".into(),
                    ));
                };
                if !tools()
                    .as_array()
                    .is_some_and(|t| t.iter().any(|t| t["name"] == name))
                {
                    return Err((-32602, format!("unknown tool {name:?}")));
                }
                let empty = Map::new();
                let args = match params.get("arguments") {
                    None | Some(Value::Null) => &empty,
                    Some(Value::Object(m)) => m,
                    Some(_) => {
                        return Ok(tool_result(
                            format!("{name}: arguments must be an object"),
                            true,
                        ))
                    }
                };
                Ok(match self.tool(name, args).await {
                    Ok(text) => tool_result(text, false),
                    Err(text) => tool_result(format!("{name}: {text}"), true),
                })
            }
            other => Err((-32601, format!("method not found: {other}"))),
        }
    }

    async fn tool(&self, name: &str, args: &Map<String, Value>) -> Result<String, String> {
        let caller = self.caller.clone().ok_or(NO_CREDENTIALS)?;
        match name {
            "start_step" => {
                let req = start_request(caller, args)?;
                let rec: ExecutionRecord = self.api(subj::STEPS_START, &req).await?;
                Ok(format!(
                    "started step {} ({}, scope {}); its result is delivered to this \
                     conversation when it ends\n{}",
                    rec.id,
                    rec.name,
                    rec.scope,
                    pretty(&rec.redacted())
                ))
            }
            "start_agent" => {
                allow_only(args, &["name", "prompt", "scope"])?;
                let text = |key: &str| -> Result<Option<String>, String> {
                    match args.get(key) {
                        None | Some(Value::Null) => Ok(None),
                        Some(Value::String(s)) if !s.trim().is_empty() => Ok(Some(s.clone())),
                        Some(_) => Err(format!("`{key}` must be a non-empty string")),
                    }
                };
                let name = text("name")?.ok_or("`name` is required (a non-empty string)")?;
                let prompt = text("prompt")?.ok_or("`prompt` is required (a non-empty string)")?;
                let scope: Scope = text("scope")?
                    .as_deref()
                    .unwrap_or("turn")
                    .parse()
                    .map_err(|e| format!("bad `scope`: {e}"))?;
                let req = StartStep {
                    caller,
                    name,
                    scope,
                    work: StepKind::Agent { prompt },
                    id: Some(StepId::new()),
                };
                let rec: ExecutionRecord = self.api(subj::STEPS_START, &req).await?;
                Ok(format!(
                    "started background agent {} ({}); its final reply is delivered to this \
                     conversation once everything it started is done\n{}",
                    rec.id,
                    rec.name,
                    pretty(&rec.redacted())
                ))
            }
            "step_status" => {
                allow_only(args, &["id"])?;
                let id = args
                    .get("id")
                    .ok_or("`id` is required (a step id, stp_...)")?;
                let id = id
                    .as_str()
                    .ok_or("`id` must be a string (a step id, stp_...)")?;
                let step: StepId = id.parse().map_err(|e| format!("bad `id`: {e}"))?;
                let rec: ExecutionRecord = self
                    .api(subj::STEPS_STATUS, &StepStatus { caller, step })
                    .await?;
                Ok(format!("{}\n{}", summary(&rec), pretty(&rec.redacted())))
            }
            _ => {
                allow_only(args, &[])?;
                let recs: Vec<ExecutionRecord> =
                    self.api(subj::STEPS_LIST, &ListSteps { caller }).await?;
                let recs: Vec<ExecutionRecord> =
                    recs.iter().map(ExecutionRecord::redacted).collect();
                let mut text: String = recs.iter().map(|r| summary(r) + "\n").collect();
                if recs.is_empty() {
                    text.push_str("no steps\n");
                }
                Ok(text + &pretty(&recs))
            }
        }
    }

    async fn api<Req: serde::Serialize, Resp: serde::de::DeserializeOwned>(
        &self,
        subject: &'static str,
        req: &Req,
    ) -> Result<Resp, String> {
        let body = serde_json::to_value(req).map_err(|e| format!("encode request: {e}"))?;
        let reply = self.backend.call(subject, body).await?;
        serde_json::from_value(reply).map_err(|e| format!("unreadable reply on {subject}: {e}"))
    }
}

fn start_request(caller: Caller, args: &Map<String, Value>) -> Result<StartStep, String> {
    allow_only(
        args,
        &["name", "command", "scope", "kind", "queue", "input"],
    )?;
    let string = |key: &str| -> Result<Option<&str>, String> {
        match args.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(_) => Err(format!("`{key}` must be a string")),
        }
    };
    let name = string("name")?
        .filter(|n| !n.trim().is_empty())
        .ok_or("`name` is required (a non-empty string)")?;
    let scope: Scope = string("scope")?
        .unwrap_or("turn")
        .parse()
        .map_err(|e| format!("bad `scope`: {e}"))?;
    let command = match args.get("command") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => Some(
            items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<String>>>()
                .ok_or("`command` must be an array of strings")?,
        ),
        Some(_) => {
            return Err(
                "`command` must be an array of strings (argv, e.g. [\"cargo\", \"test\"])".into(),
            )
        }
    };
    let input = args.get("input").cloned().unwrap_or(Value::Null);
    let queue = string("queue")?;
    let work =
        match string("kind")?.unwrap_or("command") {
            "command" => {
                if queue.is_some() || !input.is_null() {
                    return Err("`queue` and `input` are only for kind \"external\"".into());
                }
                match command {
                    Some(argv) if !argv.is_empty() => StepKind::Command { argv },
                    _ => return Err(
                        "`command` is required for a command step (a non-empty array of strings)"
                            .into(),
                    ),
                }
            }
            "external" => {
                if command.is_some() {
                    return Err("`command` is only for kind \"command\"".into());
                }
                let queue = queue
                    .filter(|q| !q.is_empty())
                    .ok_or("`queue` is required for an external step")?;
                StepKind::External {
                    queue: queue.to_string(),
                    input,
                }
            }
            other => {
                return Err(format!(
                    "unknown `kind` {other:?} (known: command, external)"
                ))
            }
        };
    Ok(StartStep {
        caller,
        name: name.to_string(),
        scope,
        work,
        id: Some(StepId::new()),
    })
}

fn allow_only(args: &Map<String, Value>, known: &[&str]) -> Result<(), String> {
    match args.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) if known.is_empty() => Err(format!("takes no arguments (got `{k}`)")),
        Some(k) => Err(format!(
            "unknown argument `{k}` (known: {})",
            known.join(", ")
        )),
        None => Ok(()),
    }
}

fn summary(r: &ExecutionRecord) -> String {
    format!(
        "{} {} [{}] {}: {}",
        r.id,
        r.status.name(),
        r.scope,
        r.name,
        r.status.summary()
    )
}

fn pretty<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("(unprintable: {e})"))
}

fn tools() -> Value {
    json!([
        {
            "name": "start_step",
            "description": "Start a step: a command run on this session's host in its working \
                directory, or external work for a worker queue. Returns at once with the step's \
                id; its result arrives in this conversation as a message when it ends.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "description": "A short label for the step."},
                    "command": {
                        "type": "array", "items": {"type": "string"}, "minItems": 1,
                        "description": "argv, no shell (use [\"sh\", \"-c\", \"...\"] for \
                            one). Required for kind command."
                    },
                    "scope": {
                        "type": "string", "enum": ["turn", "run", "detached"], "default": "turn",
                        "description": "turn: cancelled when the current turn ends; run: \
                            outlives the turn, lives until its run ends; detached: independent. \
                            The result is delivered here in every case."
                    },
                    "kind": {
                        "type": "string", "enum": ["command", "external"], "default": "command"
                    },
                    "queue": {
                        "type": "string",
                        "description": "The worker queue. Required for kind external."
                    },
                    "input": {"description": "Any JSON input for an external step."}
                },
                "required": ["name"],
                "additionalProperties": false
            }
        },
        {
            "name": "start_agent",
            "description": "Start a background agent: a new session of the same agent on this \
                host works on the prompt until everything it started is done and handed back \
                to it; its final reply then arrives in this conversation as a message.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "description": "A short label for the agent."},
                    "prompt": {"type": "string", "description": "What the agent should do."},
                    "scope": {
                        "type": "string", "enum": ["turn", "run", "detached"], "default": "turn"
                    }
                },
                "required": ["name", "prompt"],
                "additionalProperties": false
            }
        },
        {
            "name": "step_status",
            "description": "The current record of one step you own or watch.",
            "inputSchema": {
                "type": "object",
                "properties": {"id": {"type": "string", "description": "The step id (stp_...)."}},
                "required": ["id"],
                "additionalProperties": false
            },
            "annotations": {"readOnlyHint": true}
        },
        {
            "name": "list_steps",
            "description": "This session's steps (started or watched), newest first.",
            "inputSchema": {"type": "object", "properties": {}, "additionalProperties": false},
            "annotations": {"readOnlyHint": true}
        }
    ])
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use turnstile_shared::SessionId;

    /// Records each call and answers with `reply` (or an error when it is `None`).
    #[derive(Default)]
    struct Fake {
        calls: Mutex<Vec<(String, Value)>>,
        reply: Option<Value>,
    }

    impl Backend for Arc<Fake> {
        fn call(&self, subject: &'static str, req: Value) -> BoxFuture<'_, Result<Value, String>> {
            self.calls.lock().unwrap().push((subject.to_string(), req));
            let reply = self.reply.clone().ok_or("unavailable: no NATS".to_string());
            Box::pin(async move { reply })
        }
    }

    fn caller() -> Caller {
        Caller {
            session: Some(SessionId::new()),
            step: None,
            token: "tok".into(),
        }
    }

    fn server(caller: Option<Caller>, reply: Option<Value>) -> (Server<Arc<Fake>>, Arc<Fake>) {
        let fake = Arc::new(Fake {
            calls: Mutex::default(),
            reply,
        });
        (Server::new(caller, fake.clone()), fake)
    }

    fn record(id: &StepId) -> Value {
        json!({
            "id": id.to_string(), "kind": "step", "name": "build", "scope": "run",
            "session": SessionId::new().to_string(), "created_at": "2025-01-01T00:00:00Z",
            "token": "secret-token", "status": "queued"
        })
    }

    async fn ask(s: &Server<Arc<Fake>>, msg: Value) -> Value {
        s.handle_message(&msg.to_string()).await.expect("a reply")
    }

    async fn call_tool(s: &Server<Arc<Fake>>, name: &str, args: Value) -> (bool, String) {
        let params = json!({"name": name, "arguments": args});
        let r = ask(
            s,
            json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params}),
        )
        .await;
        let text = r["result"]["content"][0]["text"]
            .as_str()
            .expect("text")
            .to_string();
        (r["result"]["isError"].as_bool().expect("isError"), text)
    }

    #[tokio::test]
    async fn initialize_negotiates_the_version() {
        let (s, _) = server(None, None);
        for (asked, got) in [
            (json!("2024-11-05"), "2024-11-05"),
            (json!("2025-03-26"), "2025-03-26"),
            (json!("1999-01-01"), LATEST),
            (Value::Null, LATEST),
        ] {
            let params = json!({"protocolVersion": asked, "capabilities": {}});
            let msg =
                json!({"jsonrpc": "2.0", "id": "a", "method": "initialize", "params": params});
            let r = ask(&s, msg).await;
            assert_eq!(r["id"], "a");
            assert_eq!(r["result"]["protocolVersion"], got);
            assert_eq!(r["result"]["serverInfo"]["name"], "turnstile");
            assert_eq!(r["result"]["capabilities"]["tools"]["listChanged"], false);
            assert!(r["result"]["instructions"].is_string());
        }
    }

    #[tokio::test]
    async fn tools_list_names_and_required_fields() {
        let (s, _) = server(None, None);
        let r = ask(
            &s,
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
        )
        .await;
        let tools = r["result"]["tools"].as_array().expect("tools");
        let names: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
        assert_eq!(
            names,
            ["start_step", "start_agent", "step_status", "list_steps"]
        );
        assert_eq!(tools[0]["inputSchema"]["required"], json!(["name"]));
        assert_eq!(
            tools[1]["inputSchema"]["required"],
            json!(["name", "prompt"])
        );
        assert_eq!(tools[2]["inputSchema"]["required"], json!(["id"]));
        assert!(tools.iter().all(|t| t["inputSchema"]["type"] == "object"));
    }

    #[tokio::test]
    async fn protocol_errors_and_notifications() {
        let (s, _) = server(None, None);
        let r = ask(&s, json!({"jsonrpc": "2.0", "id": 2, "method": "nope"})).await;
        assert_eq!(r["error"]["code"], -32601);
        assert_eq!(r["id"], 2);
        let r = ask(&s, json!({"jsonrpc": "2.0", "id": 3, "method": "ping"})).await;
        assert_eq!(r["result"], json!({}));
        let r = s.handle_message("{not json").await.expect("reply");
        assert_eq!(
            (r["error"]["code"].clone(), r["id"].clone()),
            (json!(-32700), Value::Null)
        );
        let r = s
            .handle_message(r#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#)
            .await;
        assert_eq!(r.expect("reply")["error"]["code"], -32600);
        let r = ask(
            &s,
            json!({"jsonrpc": "2.0", "id": 4, "method": "tools/call",
            "params": {"name": "rm_rf"}}),
        )
        .await;
        assert_eq!(r["error"]["code"], -32602);
        let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        assert!(s.handle_message(&note.to_string()).await.is_none());
        let unknown = json!({"jsonrpc": "2.0", "method": "notifications/whatever"});
        assert!(s.handle_message(&unknown.to_string()).await.is_none());
        assert!(s.handle_message("  \n").await.is_none());
    }

    #[tokio::test]
    async fn tool_calls_without_credentials_explain_the_env() {
        let (s, fake) = server(None, None);
        let (is_error, text) = call_tool(&s, "list_steps", json!({})).await;
        assert!(is_error);
        assert!(text.contains("TURNSTILE_SESSION") && text.contains("TURNSTILE_STEP_TOKEN"));
        assert!(fake.calls.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn bad_arguments_are_tool_errors() {
        let (s, fake) = server(Some(caller()), None);
        for (tool, args, needle) in [
            (
                "start_step",
                json!({"command": ["ls"]}),
                "`name` is required",
            ),
            ("start_step", json!({"name": "x"}), "`command` is required"),
            (
                "start_step",
                json!({"name": "x", "command": "ls -l"}),
                "array of strings",
            ),
            (
                "start_step",
                json!({"name": "x", "command": ["ls", 1]}),
                "array of strings",
            ),
            (
                "start_step",
                json!({"name": "x", "command": ["ls"], "scope": "forever"}),
                "scope",
            ),
            (
                "start_step",
                json!({"name": "x", "kind": "external"}),
                "`queue` is required",
            ),
            (
                "start_step",
                json!({"name": "x", "kind": "lambda"}),
                "unknown `kind`",
            ),
            (
                "start_step",
                json!({"name": "x", "cmd": ["ls"]}),
                "unknown argument `cmd`",
            ),
            ("step_status", json!({}), "`id` is required"),
            ("step_status", json!({"id": 5}), "must be a string"),
            ("step_status", json!({"id": "trn_abc"}), "bad `id`"),
            ("list_steps", json!({"all": true}), "takes no arguments"),
            ("list_steps", json!([1]), "arguments must be an object"),
        ] {
            let (is_error, text) = call_tool(&s, tool, args.clone()).await;
            assert!(is_error, "{tool} {args}");
            assert!(text.contains(needle), "{tool} {args}: {text}");
        }
        assert!(fake.calls.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn start_step_sends_the_request_and_reports_the_record() {
        let id = StepId::new();
        let (s, fake) = server(Some(caller()), Some(record(&id)));
        let args = json!({"name": "build", "command": ["cargo", "build"], "scope": "run"});
        let (is_error, text) = call_tool(&s, "start_step", args).await;
        assert!(!is_error, "{text}");
        assert!(text.starts_with(&format!("started step {id} (build, scope run)")));
        assert!(!text.contains("secret-token"));
        let calls = fake.calls.lock().unwrap();
        let (subject, req) = &calls[0];
        assert_eq!(subject, subj::STEPS_START);
        assert_eq!(
            req["work"],
            json!({"kind": "command", "argv": ["cargo", "build"]})
        );
        assert_eq!(req["scope"], "run");
        assert!(req["id"].as_str().is_some_and(|i| i.starts_with("stp_")));
        assert_eq!(req["caller"]["token"], "tok");
    }

    #[tokio::test]
    async fn status_list_and_api_failures() {
        let id = StepId::new();
        let (s, fake) = server(Some(caller()), Some(record(&id)));
        let (is_error, text) = call_tool(&s, "step_status", json!({"id": id.to_string()})).await;
        assert!(!is_error, "{text}");
        assert!(text.starts_with(&format!("{id} queued")));
        assert_eq!(fake.calls.lock().unwrap()[0].1["step"], id.to_string());

        let (s, _) = server(Some(caller()), Some(json!([record(&id)])));
        let (is_error, text) = call_tool(&s, "list_steps", Value::Null).await;
        assert!(!is_error, "{text}");
        assert!(text.starts_with(&format!("{id} queued [run] build")));

        let (s, _) = server(Some(caller()), None);
        let (is_error, text) = call_tool(&s, "list_steps", json!({})).await;
        assert!(is_error && text.contains("no NATS"), "{text}");
    }
}
