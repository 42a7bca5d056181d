//! `--http`: `/healthz` and `/readyz`. A service on its own identity becomes ready; one whose
//! identity lacks a subject it needs (here a broker on the scheduler's user) is refused by the
//! server and reports itself not ready, with the server's words, while still healthy.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use turnstile_tests::{free_port, wait_until, ServiceProcess};

use crate::stack::{report, Stack};

/// `GET path` on 127.0.0.1:`port`: the status code and the body.
pub(crate) async fn get(port: u16, path: &str) -> Result<(u16, String)> {
    get_as(port, "t", path).await
}

/// `GET path` on 127.0.0.1:`port` with `host` as the `Host` header (within 20 s).
pub(crate) async fn get_as(port: u16, host: &str, path: &str) -> Result<(u16, String)> {
    tokio::time::timeout(Duration::from_secs(20), request(port, host, path))
        .await
        .with_context(|| format!("GET {path} on port {port} took over 20 s"))?
}

async fn request(port: u16, host: &str, path: &str) -> Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await?;
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no status line")?;
    let body = raw.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
    Ok((status, body))
}

/// Waits until `path` answers `status`; returns the body.
async fn until(port: u16, path: &str, status: u16) -> Result<String> {
    wait_until(
        &format!("{path} to answer {status}"),
        Duration::from_secs(20),
        || async {
            Ok(match get(port, path).await {
                Ok((s, body)) if s == status => Some(body),
                _ => None,
            })
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_permission_makes_a_service_not_ready() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = health(&mut stack).await;
    report(&stack, r)
}

async fn health(stack: &mut Stack) -> Result<()> {
    let spawn = |role: &str, replica: &str, port: u16| {
        ServiceProcess::spawn_in(
            stack.dir.path(),
            "turnstile-notification-broker",
            &[
                "--replica".to_string(),
                replica.to_string(),
                "--http".to_string(),
                format!("127.0.0.1:{port}"),
            ],
            &stack.env_as(role),
            replica,
        )
    };
    // On its own identity: healthy, then ready.
    let good = free_port()?;
    let _b2 = spawn("notification-broker", "b2", good)?;
    let body = until(good, "/readyz", 200).await?;
    ensure!(body.contains("ready"), "{body}");
    let (status, body) = get(good, "/healthz").await?;
    ensure!(
        status == 200 && body.contains("NATS connected"),
        "{status} {body}"
    );
    let (status, _) = get(good, "/nowhere").await?;
    ensure!(status == 404, "{status}");

    // On an identity that lacks its subjects: refused, so not ready, and says why; still up.
    let bad = free_port()?;
    let _wrong = spawn("scheduler", "test-wrong-identity", bad)?;
    let body = until(bad, "/readyz", 503).await?;
    let body = if body.contains("refused") {
        body
    } else {
        wait_until("the refusal to show", Duration::from_secs(20), || async {
            Ok(get(bad, "/readyz")
                .await
                .ok()
                .filter(|(_, b)| b.contains("refused"))
                .map(|(_, b)| b))
        })
        .await?
    };
    ensure!(body.contains("Permissions Violation"), "{body}");
    let (status, body) = get(bad, "/healthz").await?;
    ensure!(status == 200, "{status} {body}");
    Ok(())
}
