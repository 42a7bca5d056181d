//! `turnstile mcp`: an MCP server over stdio for agents (placeholder, being written).

use std::process::ExitCode;

pub async fn run(_url: &str) -> anyhow::Result<ExitCode> {
    anyhow::bail!("turnstile mcp is not built yet")
}
