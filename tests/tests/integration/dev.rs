//! `turnstile dev` runs with a deployment's accounts: it says where the operator's credentials
//! are, the CLI works with them, a client without credentials is refused, the demo's agent
//! starts its steps on its own callout-issued identity, and no service is refused anything.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_tests::{bin_path, free_port, wait_until, ServiceProcess};

use crate::stack::signal;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turnstile_dev_runs_on_its_own_accounts_and_says_where_the_operator_credentials_are(
) -> Result<()> {
    let dir = tempfile::Builder::new().prefix("ts-dev-").tempdir()?;
    let data = dir.path().join("data");
    let port = free_port()?.to_string();
    let args = [
        "dev",
        "--port",
        &port,
        "--data-dir",
        &data.to_string_lossy(),
    ]
    .map(String::from);
    let mut dev = ServiceProcess::spawn_in(dir.path(), "turnstile", &args, &[], "dev")?;
    let r = check(&mut dev, &data, &port).await;
    if r.is_err() {
        eprintln!("{}", dev.log_tail(200));
        eprintln!(
            "{}",
            std::fs::read_to_string(data.join("nats-server.log")).unwrap_or_default()
        );
    }
    r
}

async fn check(dev: &mut ServiceProcess, data: &std::path::Path, port: &str) -> Result<()> {
    // It prints where the operator's credentials are.
    let file = wait_until(
        "the credentials' location",
        Duration::from_secs(60),
        || async {
            let log = dev.log_tail(50);
            Ok(log.lines().find_map(|l| {
                let rest = l.split("operator credentials: ").nth(1)?;
                Some(rest.split(';').next()?.trim().to_string())
            }))
        },
    )
    .await?;
    let env = std::fs::read_to_string(&file).with_context(|| format!("read {file}"))?;
    let url = env
        .trim()
        .strip_prefix("TURNSTILE_NATS_URL=")
        .context("no URL in the credentials file")?
        .to_string();
    ensure!(url.starts_with("nats://cli:"), "{url}");
    ensure!(url.ends_with(&format!("@127.0.0.1:{port}")), "{url}");
    // The operator's CLI works with them, and sees the demo session.
    let cli = bin_path("turnstile")?;
    let listed = wait_until("the demo session", Duration::from_secs(60), || async {
        let out = tokio::process::Command::new(&cli)
            .args(["session", "list"])
            .env("TURNSTILE_NATS_URL", &url)
            .output()
            .await?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        Ok((out.status.success() && text.contains("demo")).then_some(text))
    })
    .await?;
    ensure!(listed.contains("mock"), "{listed}");
    // Without credentials: refused.
    let out = tokio::process::Command::new(&cli)
        .args(["session", "list"])
        .env("TURNSTILE_NATS_URL", format!("nats://127.0.0.1:{port}"))
        .output()
        .await?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && err.contains("authorization violation"),
        "{err}"
    );
    // The demo's scheduled run starts steps from its agent (on a callout-issued identity).
    wait_until("the demo's steps", Duration::from_secs(60), || async {
        Ok(dev.log_tail(400).contains("step.completed").then_some(()))
    })
    .await?;
    // Nobody was refused a permission.
    let log = std::fs::read_to_string(data.join("nats-server.log"))?;
    let refused: Vec<&str> = log.lines().filter(|l| l.contains("Violation")).collect();
    ensure!(refused.is_empty(), "{}", refused.join("\n"));
    // Ctrl-C (SIGTERM) ends it.
    signal(dev.pid().context("dev pid")?, rustix::process::Signal::TERM)?;
    dev.wait_exit(Duration::from_secs(30)).await?;
    Ok(())
}
