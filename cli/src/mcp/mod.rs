//! `turnstile mcp`: an MCP server over stdio, so a coding agent can start and inspect steps
//! through tools instead of shelling out to `turnstile step`. Built on rmcp, the official Rust
//! MCP SDK, which owns the JSON-RPC framing, the protocol version and the tool schemas; this
//! file wires the four tools into it (parameters in `params.rs`, logic in `tools.rs`, the
//! broker API behind `backend.rs`).

mod backend;
mod params;
mod tools;

use std::process::ExitCode;

use anyhow::Context as _;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{Implementation, ServerCapabilities, ServerConfig};
use rmcp::{tool, tool_handler, tool_router, ServerHandler, ServiceExt};
use turnstile_shared::step_api::Caller;

use backend::{Backend, Nats};
use params::{ListStepsParams, StartAgentParams, StartStepParams, StepStatusParams};
use tools::{Tools, NO_CREDENTIALS};

const INSTRUCTIONS: &str = "Turnstile runs work as steps beside this conversation. start_step \
    returns at once; the step goes on after your turn ends and its result is delivered to this \
    conversation as a new message when it ends, so do not poll or wait for it: end your turn. \
    Use step_status or list_steps only to inspect.";

/// Serves MCP on stdin/stdout until the client closes stdin.
pub async fn run(url: &str) -> anyhow::Result<ExitCode> {
    let caller = Caller::from_env().filter(|c| c.session.is_some() || c.step.is_some());
    if caller.is_none() {
        eprintln!("{NO_CREDENTIALS}");
    }
    let service = Server::new(caller.clone(), Nats::new(url, caller))
        .serve(rmcp::transport::stdio())
        .await
        .context("MCP initialization")?;
    service.waiting().await.context("MCP service")?;
    Ok(ExitCode::SUCCESS)
}

/// The MCP server: the tool logic behind rmcp's tool router.
pub struct Server<B> {
    tools: Tools<B>,
    router: ToolRouter<Self>,
}

impl<B: Backend> Server<B> {
    pub fn new(caller: Option<Caller>, backend: B) -> Self {
        Self {
            tools: Tools::new(caller, backend),
            router: Self::tool_router(),
        }
    }
}

#[tool_router]
impl<B: Backend> Server<B> {
    #[tool(
        description = "Start a step: a command run on this session's host in its working \
        directory, or external work for a worker queue. Returns at once with the step's id; \
        the step runs beside this conversation and its result (status and output) is \
        delivered to this conversation as a new message when it ends, so do not poll or wait \
        for it: carry on, or end your turn. By default (scope session) it goes on after your \
        turn ends, until it finishes, your run fails or this session stops."
    )]
    async fn start_step(
        &self,
        Parameters(p): Parameters<StartStepParams>,
    ) -> Result<String, String> {
        self.tools.start_step(p).await
    }

    #[tool(
        description = "Start a background agent: a new session of the same agent on this \
        host works on the prompt until everything it started is done and handed back to it. \
        Returns at once; the agent's final reply is delivered to this conversation as a new \
        message, so do not poll for it. By default (scope session) it goes on after your turn \
        ends."
    )]
    async fn start_agent(
        &self,
        Parameters(p): Parameters<StartAgentParams>,
    ) -> Result<String, String> {
        self.tools.start_agent(p).await
    }

    #[tool(
        description = "The current record of one step you own or watch (status, scope, \
            parent, result summary). For inspection only: results arrive on their own.",
        annotations(read_only_hint = true)
    )]
    async fn step_status(
        &self,
        Parameters(p): Parameters<StepStatusParams>,
    ) -> Result<String, String> {
        self.tools.step_status(p).await
    }

    #[tool(
        description = "This session's steps (started or watched), newest first, one summary \
            line each, then their records. For inspection only: results arrive on their own.",
        annotations(read_only_hint = true)
    )]
    async fn list_steps(
        &self,
        Parameters(p): Parameters<ListStepsParams>,
    ) -> Result<String, String> {
        self.tools.list_steps(p).await
    }
}

#[tool_handler(router = self.router)]
impl<B: Backend> ServerHandler for Server<B> {
    /// The SDK's current protocol version, the tools capability and the instructions.
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("turnstile", env!("CARGO_PKG_VERSION")))
            .with_instructions(INSTRUCTIONS)
    }
}

/// The server driven in-process over a duplex pipe, as raw JSON-RPC lines (what a client
/// writes on the server's stdin), so the wire format rmcp produces is what is checked.
#[cfg(test)]
mod tests {
    use serde_json::{json, Value};
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, DuplexStream, Lines};
    use tokio::io::{ReadHalf, WriteHalf};
    use turnstile_shared::StepId;

    use super::backend::fake::{caller, fake, record};
    use super::*;

    struct Client {
        tx: WriteHalf<DuplexStream>,
        rx: Lines<BufReader<ReadHalf<DuplexStream>>>,
    }

    impl Client {
        async fn send(&mut self, msg: Value) {
            let line = format!("{msg}\n");
            self.tx.write_all(line.as_bytes()).await.unwrap();
        }

        /// Sends a request and reads lines until its reply.
        async fn ask(&mut self, id: u64, method: &str, params: Value) -> Value {
            self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
                .await;
            let reply = tokio::time::timeout(std::time::Duration::from_secs(10), async {
                loop {
                    let line = self.rx.next_line().await.unwrap().expect("a reply line");
                    let msg: Value = serde_json::from_str(&line).unwrap();
                    if msg["id"] == id {
                        return msg;
                    }
                }
            });
            reply.await.expect("a reply in time")
        }
    }

    #[tokio::test]
    async fn serves_initialize_tools_list_and_calls_over_a_pipe() {
        let id = StepId::new();
        let (fake, backend) = fake(Some(record(&id)));
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let server = tokio::spawn(async move {
            let running = Server::new(Some(caller()), backend)
                .serve(server_io)
                .await
                .map_err(|e| e.to_string())?;
            running.waiting().await.map_err(|e| e.to_string())
        });
        let (rx, tx) = tokio::io::split(client_io);
        let mut c = Client {
            tx,
            rx: BufReader::new(rx).lines(),
        };

        let hello = json!({"protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "test", "version": "0"}});
        let r = c.ask(1, "initialize", hello).await;
        assert_eq!(r["result"]["protocolVersion"], "2025-06-18", "{r}");
        assert_eq!(r["result"]["serverInfo"]["name"], "turnstile");
        assert_eq!(r["result"]["instructions"], INSTRUCTIONS);
        assert!(r["result"]["capabilities"]["tools"].is_object(), "{r}");
        c.send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await;

        let r = c.ask(2, "tools/list", json!({})).await;
        let tools = r["result"]["tools"].as_array().expect("tools");
        let tool = |name: &str| -> &Value { tools.iter().find(|t| t["name"] == name).expect(name) };
        assert_eq!(tools.len(), 4, "{r}");
        for (name, required) in [
            ("start_step", json!(["name"])),
            ("start_agent", json!(["name", "prompt"])),
            ("step_status", json!(["id"])),
        ] {
            let schema = &tool(name)["inputSchema"];
            assert_eq!(schema["type"], "object", "{name}: {schema}");
            assert_eq!(schema["required"], required, "{name}: {schema}");
            assert_eq!(schema["additionalProperties"], false, "{name}: {schema}");
        }
        let list = &tool("list_steps")["inputSchema"];
        assert_eq!(list["type"], "object", "{list}");
        assert_eq!(list["properties"], json!({}), "{list}");
        assert!(list.get("required").is_none(), "{list}");
        let step = &tool("start_step");
        assert!(step["description"]
            .as_str()
            .is_some_and(|d| d.contains("do not poll")));
        let props = &step["inputSchema"]["properties"];
        assert!(props["name"]["description"].is_string(), "{props}");
        assert_eq!(props["scope"]["default"], "session", "{props}");
        assert_eq!(tool("step_status")["annotations"]["readOnlyHint"], true);

        let call = json!({"name": "start_step",
            "arguments": {"name": "build", "command": ["cargo", "build"]}});
        let r = c.ask(3, "tools/call", call).await;
        assert_eq!(r["result"]["isError"], false, "{r}");
        let text = r["result"]["content"][0]["text"].as_str().expect("text");
        assert!(
            text.starts_with(&format!("started step {id} (build")),
            "{text}"
        );
        assert_eq!(fake.calls.lock().unwrap().len(), 1);

        // Bad arguments are a tool result with isError, not a protocol error.
        let call = json!({"name": "start_step", "arguments": {"name": "x", "command": "ls"}});
        let r = c.ask(4, "tools/call", call).await;
        assert_eq!(r["result"]["isError"], true, "{r}");
        let call = json!({"name": "start_step", "arguments": {"name": "x"}});
        let r = c.ask(5, "tools/call", call).await;
        assert_eq!(r["result"]["isError"], true, "{r}");
        let text = r["result"]["content"][0]["text"].as_str().expect("text");
        assert!(
            text.starts_with("start_step: `command` is required"),
            "{text}"
        );
        assert_eq!(fake.calls.lock().unwrap().len(), 1);
        // An unknown tool is a protocol error.
        let r = c.ask(6, "tools/call", json!({"name": "rm_rf"})).await;
        assert!(r["error"]["code"].is_i64(), "{r}");

        // EOF on the server's input ends it.
        drop(c);
        let ended = tokio::time::timeout(std::time::Duration::from_secs(10), server).await;
        assert!(ended.expect("the server ends").expect("join").is_ok());
    }

    #[tokio::test]
    async fn an_unknown_protocol_version_gets_the_sdks_current_one() {
        let (_, backend) = fake(None);
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        tokio::spawn(async move {
            if let Ok(running) = Server::new(None, backend).serve(server_io).await {
                let _ = running.waiting().await;
            }
        });
        let (rx, tx) = tokio::io::split(client_io);
        let mut c = Client {
            tx,
            rx: BufReader::new(rx).lines(),
        };
        let hello = json!({"protocolVersion": "1999-01-01", "capabilities": {},
            "clientInfo": {"name": "test", "version": "0"}});
        let r = c.ask(1, "initialize", hello).await;
        assert_eq!(
            r["result"]["protocolVersion"],
            rmcp::model::ProtocolVersion::LATEST_WITH_INITIALIZE.as_str(),
            "{r}"
        );
        c.send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await;
        // Without credentials, a tool call explains which environment it needs.
        let r = c
            .ask(
                2,
                "tools/call",
                json!({"name": "list_steps", "arguments": {}}),
            )
            .await;
        assert_eq!(r["result"]["isError"], true, "{r}");
        let text = r["result"]["content"][0]["text"].as_str().expect("text");
        assert!(text.contains("TURNSTILE_SESSION"), "{text}");
    }
}
