//! A scripted model server for the real agent CLIs: Claude Code talks to it through
//! `ANTHROPIC_BASE_URL` (the Messages API, `POST /v1/messages`, streamed as named SSE events)
//! and Codex through a `model_providers` entry (the Responses API, `POST /v1/responses`).
//! A test pushes the replies its turn needs (text, or a tool call the CLI then runs), and
//! reads back what each CLI sent. A request with nothing scripted gets the text `ok`.
//!
//! Deliberately small: HTTP/1.1 with one request per connection (`Connection: close`), the
//! request body read by `Content-Length` (or chunked), no validation beyond what the replies
//! need. It answers what the CLIs send as observed from the real binaries, not from docs.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Which wire protocol the server speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// Anthropic's Messages API (Claude Code).
    Messages,
    /// OpenAI's Responses API (Codex).
    Responses,
}

/// One scripted model reply.
#[derive(Debug, Clone)]
pub enum Reply {
    /// Assistant text; the turn ends.
    Text(String),
    /// A call of the CLI's tool `name` with `input` (Claude: a `tool_use` block; Codex: a
    /// `function_call`, with `namespace` for an MCP tool, e.g. `mcp__turnstile`).
    Tool {
        name: String,
        namespace: Option<String>,
        input: Value,
    },
    /// No answer at all until the client goes away (a model that is still thinking).
    Stall,
    /// The API refuses the request: HTTP 400 with this message in each API's error shape;
    /// retries are refused too, until the next reply is queued.
    Refuse(String),
}

impl Reply {
    pub fn text(t: impl Into<String>) -> Self {
        Reply::Text(t.into())
    }

    pub fn tool(name: impl Into<String>, input: Value) -> Self {
        Reply::Tool {
            name: name.into(),
            namespace: None,
            input,
        }
    }

    /// Codex's MCP tools are called as `namespace` + `name` (`mcp__<server>`, the tool).
    pub fn namespaced(namespace: impl Into<String>, name: impl Into<String>, input: Value) -> Self {
        Reply::Tool {
            name: name.into(),
            namespace: Some(namespace.into()),
            input,
        }
    }
}

#[derive(Default)]
struct State {
    script: VecDeque<Reply>,
    requests: Vec<Value>,
    served: u64,
}

/// The running server; stops when dropped.
pub struct ModelServer {
    url: String,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl ModelServer {
    pub async fn start(api: Api) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let state = shared.clone();
                tokio::spawn(async move {
                    if let Err(e) = serve(api, conn, state).await {
                        tracing::debug!(error = %e, "model server connection");
                    }
                });
            }
        });
        Ok(Self {
            url: format!("http://{addr}"),
            state,
            task,
        })
    }

    /// `http://127.0.0.1:<port>` (Codex's provider wants `<url>/v1`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Queues the next reply (replies are served in order, one per model request; a
    /// [`Reply::Refuse`] answers every request until the next reply is queued).
    pub fn push(&self, reply: Reply) {
        if let Ok(mut s) = self.state.lock() {
            if matches!(s.script.front(), Some(Reply::Refuse(_))) {
                s.script.pop_front();
            }
            s.script.push_back(reply);
        }
    }

    /// The JSON bodies of every model request so far.
    pub fn requests(&self) -> Vec<Value> {
        self.state
            .lock()
            .map(|s| s.requests.clone())
            .unwrap_or_default()
    }

    /// Replies still queued.
    pub fn pending(&self) -> usize {
        self.state.lock().map(|s| s.script.len()).unwrap_or(0)
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Every text a user (not the CLI's own system reminders) put into a request, in order.
pub fn user_texts(request: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for item in items(request) {
        if item.get("role").and_then(Value::as_str) != Some("user") {
            continue;
        }
        match item.get("content") {
            Some(Value::String(s)) => out.push(s.clone()),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        out.push(t.to_string());
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// Tool results the CLI sent back (Claude's `tool_result` blocks, Codex's
/// `function_call_output` items), as text.
pub fn tool_results(request: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for item in items(request) {
        if item.get("type").and_then(Value::as_str) == Some("function_call_output") {
            out.push(flatten(item.get("output")));
        }
        if let Some(parts) = item.get("content").and_then(Value::as_array) {
            for p in parts {
                if p.get("type").and_then(Value::as_str) == Some("tool_result") {
                    out.push(flatten(p.get("content")));
                }
            }
        }
    }
    out
}

/// The conversation a request carries: Claude's `messages`, Codex's `input`.
fn items(request: &Value) -> Vec<Value> {
    request
        .get("messages")
        .or_else(|| request.get("input"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

fn flatten(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        Some(other) => other.to_string(),
        None => String::new(),
    }
}

/// One request on one connection.
async fn serve(api: Api, mut conn: TcpStream, state: Arc<Mutex<State>>) -> Result<()> {
    let (head, body) = read_request(&mut conn).await?;
    let request_line = head.lines().next().unwrap_or_default().to_string();
    let mut parts = request_line.split_whitespace();
    let method = parts.next().unwrap_or_default();
    let path = parts.next().unwrap_or_default();
    let is_model_call = method == "POST"
        && match api {
            Api::Messages => path.starts_with("/v1/messages") && !path.contains("count_tokens"),
            Api::Responses => path.ends_with("/responses"),
        };
    if !is_model_call {
        // Warm-ups and probes (`HEAD /api/hello`, ...): an empty success.
        let reply = if method == "POST" { "{}" } else { "" };
        return respond(&mut conn, "application/json", reply.as_bytes()).await;
    }
    let request: Value = serde_json::from_slice(&body).context("model request body")?;
    let (reply, n) = {
        let mut s = state
            .lock()
            .map_err(|_| anyhow::anyhow!("model server state poisoned"))?;
        s.requests.push(request);
        s.served += 1;
        // A refusal stays until the next reply is queued: the CLIs retry a refused request
        // (Claude Code several times, even with its retries off).
        let reply = match s.script.front() {
            Some(Reply::Refuse(m)) => Reply::Refuse(m.clone()),
            _ => s.script.pop_front().unwrap_or_else(|| Reply::text("ok")),
        };
        (reply, s.served)
    };
    let events = match (&reply, api) {
        (Reply::Refuse(message), _) => {
            let body = match api {
                Api::Messages => {
                    json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}})
                }
                Api::Responses => {
                    json!({"error": {"type": "invalid_request_error", "code": "invalid_request", "message": message}})
                }
            };
            return respond_status(
                &mut conn,
                "400 Bad Request",
                "application/json",
                body.to_string().as_bytes(),
            )
            .await;
        }
        (Reply::Stall, _) => {
            // Hold the connection until the CLI gives up or is killed.
            let mut sink = [0u8; 1024];
            let _ = tokio::time::timeout(Duration::from_secs(600), conn.read(&mut sink)).await;
            return Ok(());
        }
        (_, Api::Messages) => messages_events(&reply, n),
        (_, Api::Responses) => responses_events(&reply, n),
    };
    respond(&mut conn, "text/event-stream", events.as_bytes()).await
}

async fn read_request(conn: &mut TcpStream) -> Result<(String, Vec<u8>)> {
    let mut buf = Vec::with_capacity(8192);
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i;
        }
        if buf.len() > 1 << 20 {
            bail!("request head over 1 MiB");
        }
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed before a request");
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut rest = buf[head_end + 4..].to_vec();
    let header = |name: &str| {
        head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    if let Some(len) = header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        while rest.len() < len {
            let n = conn.read(&mut chunk).await?;
            if n == 0 {
                bail!("connection closed inside the body");
            }
            rest.extend_from_slice(&chunk[..n]);
        }
        rest.truncate(len);
        return Ok((head, rest));
    }
    if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            if let Some(body) = dechunk(&rest) {
                return Ok((head, body));
            }
            let n = conn.read(&mut chunk).await?;
            if n == 0 {
                bail!("connection closed inside a chunked body");
            }
            rest.extend_from_slice(&chunk[..n]);
        }
    }
    Ok((head, Vec::new()))
}

/// The body of a complete chunked encoding, or `None` while more is needed.
fn dechunk(raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let line_end = at + find(&raw[at..], b"\r\n")?;
        let size_text = String::from_utf8_lossy(&raw[at..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        at = line_end + 2;
        if size == 0 {
            return Some(out);
        }
        if raw.len() < at + size + 2 {
            return None;
        }
        out.extend_from_slice(&raw[at..at + size]);
        at += size + 2;
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

async fn respond(conn: &mut TcpStream, content_type: &str, body: &[u8]) -> Result<()> {
    respond_status(conn, "200 OK", content_type, body).await
}

async fn respond_status(
    conn: &mut TcpStream,
    status: &str,
    content_type: &str,
    body: &[u8],
) -> Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(body).await?;
    conn.flush().await?;
    let _ = conn.shutdown().await;
    Ok(())
}

fn sse(events: &[(&str, Value)]) -> String {
    events
        .iter()
        .map(|(name, data)| format!("event: {name}\ndata: {data}\n\n"))
        .collect()
}

/// Claude Code requires named events and a `content_block_stop` per block.
fn messages_events(reply: &Reply, n: u64) -> String {
    let start = json!({"type": "message_start", "message": {
        "id": format!("msg_{n}"), "type": "message", "role": "assistant", "model": "scripted",
        "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": 1, "output_tokens": 1}}});
    let (block, delta, stop_reason) = match reply {
        Reply::Tool { name, input, .. } => (
            json!({"type": "tool_use", "id": format!("toolu_{n}"), "name": name, "input": {}}),
            json!({"type": "input_json_delta", "partial_json": input.to_string()}),
            "tool_use",
        ),
        Reply::Text(t) => (
            json!({"type": "text", "text": ""}),
            json!({"type": "text_delta", "text": t}),
            "end_turn",
        ),
        Reply::Stall | Reply::Refuse(_) => return String::new(),
    };
    sse(&[
        ("message_start", start),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": block}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": delta}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null},
                   "usage": {"output_tokens": 1}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ])
}

/// Codex reads the finished output item (`response.output_item.done`) and the completion.
fn responses_events(reply: &Reply, n: u64) -> String {
    let item = match reply {
        Reply::Text(t) => json!({"type": "message", "id": format!("msg_{n}"), "role": "assistant",
            "content": [{"type": "output_text", "text": t, "annotations": []}]}),
        Reply::Tool {
            name,
            namespace,
            input,
        } => {
            let mut item = json!({"type": "function_call", "id": format!("fc_{n}"),
                "call_id": format!("call_{n}"), "name": name, "arguments": input.to_string()});
            if let Some(ns) = namespace {
                item["namespace"] = json!(ns);
            }
            item
        }
        Reply::Stall | Reply::Refuse(_) => return String::new(),
    };
    let id = format!("resp_{n}");
    sse(&[
        (
            "response.created",
            json!({"type": "response.created", "response": {"id": id}}),
        ),
        (
            "response.output_item.added",
            json!({"type": "response.output_item.added", "output_index": 0, "item": item}),
        ),
        (
            "response.output_item.done",
            json!({"type": "response.output_item.done", "output_index": 0, "item": item}),
        ),
        (
            "response.completed",
            json!({"type": "response.completed", "response": {"id": id, "usage": {
                "input_tokens": 1, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 2}}}),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunked_body_is_read_whole_or_not_at_all() {
        assert_eq!(
            dechunk(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n").as_deref(),
            Some(&b"hello world"[..])
        );
        assert_eq!(dechunk(b"5\r\nhel"), None);
    }

    #[test]
    fn user_texts_skip_system_items_and_tool_results() {
        let req = json!({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>x"}, {"type": "text", "text": "-hi"}]},
            {"role": "system", "content": "env"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "done"}]}
        ]});
        assert_eq!(user_texts(&req), vec!["<system-reminder>x", "-hi"]);
        assert_eq!(tool_results(&req), vec!["done"]);
    }
}
