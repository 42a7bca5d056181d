//! `turnstile dashboard` in a real browser: Debian's Chromium, headless, driven over the
//! DevTools protocol by `tests/dashboard_browser.py`, loads the page served with the read-only
//! observer identity before a run starts. The run's tree must appear and its step must go from
//! running to completed on the same page (one snapshot, no reload) while the session shows busy
//! and then idle (read off the lane when events say it changed), a screenshot is saved, and
//! a fresh load must show the finished tree from the snapshot alone. Neither the page nor the
//! snapshot may carry the session's token or the identity's password.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::ChildStdout;
use turnstile_tests::{artifact, bin_path, workspace_root};

use crate::health::{get, get_as};
use crate::stack::{report, Stack};

/// Debian's Chromium: `TURNSTILE_CHROMIUM`, else `chromium` on the PATH
/// (`scripts/install-chromium.sh` installs it and prints its path).
fn chromium() -> Result<String> {
    if let Ok(p) = std::env::var("TURNSTILE_CHROMIUM") {
        if !p.is_empty() {
            return Ok(p);
        }
    }
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        for name in ["chromium", "chromium-browser"] {
            if dir.join(name).is_file() {
                return Ok(dir.join(name).display().to_string());
            }
        }
    }
    bail!("no Chromium: run scripts/install-chromium.sh (scripts/test.sh does)")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_a_runs_tree_live_in_headless_chromium() -> Result<()> {
    let chromium = chromium()?;
    let python = crate::mcp::python()?;
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = dashboard(&mut stack, &python, &chromium).await;
    report(&stack, r)
}

async fn next_line(
    lines: &mut Lines<BufReader<ChildStdout>>,
    what: &str,
    secs: u64,
) -> Result<String> {
    tokio::time::timeout(Duration::from_secs(secs), lines.next_line())
        .await
        .with_context(|| format!("no {what} within {secs} s"))??
        .with_context(|| format!("output ended before {what}"))
}

async fn dashboard(stack: &mut Stack, python: &str, chromium: &str) -> Result<()> {
    let s = stack.create_session("watched", None).await?;
    let password = stack.password("observer")?;
    let scratch = tempfile::tempdir()?;
    let server_log = scratch.path().join("dashboard.log");
    let mut server = tokio::process::Command::new(bin_path("turnstile")?)
        .args(["dashboard", "--http", "127.0.0.1:0"])
        .env(
            "TURNSTILE_NATS_URL",
            stack.nats.url_as("observer", &password),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&server_log)?)
        .kill_on_drop(true)
        .spawn()
        .context("start turnstile dashboard")?;
    let mut out = BufReader::new(server.stdout.take().context("no stdout")?).lines();
    let first = next_line(&mut out, "the dashboard's address", 30).await?;
    ensure!(
        !first.contains(&password),
        "the address line shows the password"
    );
    // `dashboard: http://127.0.0.1:PORT/ (NATS ...)`
    let url = first
        .split_whitespace()
        .nth(1)
        .filter(|u| u.starts_with("http://127.0.0.1:"))
        .with_context(|| format!("first line: {first:?}"))?
        .to_string();
    let port: u16 = url
        .trim_start_matches("http://127.0.0.1:")
        .trim_end_matches('/')
        .parse()
        .with_context(|| format!("the port in {url}"))?;
    let r = browse(stack, &s, python, chromium, &url, port, &password, &scratch).await;
    r.with_context(|| {
        format!(
            "dashboard log:\n{}",
            std::fs::read_to_string(&server_log).unwrap_or_default()
        )
    })
}

#[allow(clippy::too_many_arguments)]
async fn browse(
    stack: &Stack,
    s: &turnstile_shared::SessionId,
    python: &str,
    chromium: &str,
    url: &str,
    port: u16,
    password: &str,
    scratch: &tempfile::TempDir,
) -> Result<()> {
    let screenshot = artifact("dashboard.png")?;
    let _ = std::fs::remove_file(&screenshot);
    let html = scratch.path().join("page.html");
    let browser_log = scratch.path().join("chromium.log");
    let script = workspace_root().join("tests").join("dashboard_browser.py");
    let mut driver = tokio::process::Command::new(python)
        .arg(&script)
        .args([chromium, url, "--step", "build", "--timeout", "60"])
        .args(["--session", s.as_str()])
        .arg("--screenshot")
        .arg(&screenshot)
        .arg("--html")
        .arg(&html)
        .arg("--log")
        .arg(&browser_log)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("run {python} {}", script.display()))?;
    let mut stdin = driver.stdin.take().context("no stdin")?;
    let mut lines = BufReader::new(driver.stdout.take().context("no stdout")?).lines();
    let mut seen = Vec::new();
    let result = async {
        let loaded = next_line(&mut lines, "the page's first snapshot", 150).await?;
        ensure!(loaded == "loaded", "driver: {loaded}");
        // The page is open before the run exists: everything of it arrives as events.
        let run = stack
            .start_run(
                s,
                &["build it\n!step build 3s --scope run\n!sleep 1s"],
                None,
            )
            .await?;
        stdin.write_all(format!("{}\n", run.id).as_bytes()).await?;
        stdin.flush().await?;
        loop {
            let line = next_line(&mut lines, "the driver's next step", 200).await?;
            seen.push(line.clone());
            if line == "snapshot ok" || line.starts_with("timed out") || line.starts_with("failed")
            {
                break;
            }
        }
        anyhow::Ok(())
    }
    .await;
    // Whatever the driver printed after, for the failure message.
    while let Ok(Ok(Some(l))) =
        tokio::time::timeout(Duration::from_secs(5), lines.next_line()).await
    {
        seen.push(l);
    }
    // A driver still waiting for a run id stops at the end of its input.
    drop(stdin);
    let status = tokio::time::timeout(Duration::from_secs(20), driver.wait()).await;
    let mut stderr = String::new();
    if let Some(mut e) = driver.stderr.take() {
        use tokio::io::AsyncReadExt;
        let _ = tokio::time::timeout(Duration::from_secs(5), e.read_to_string(&mut stderr)).await;
    }
    let log = std::fs::read_to_string(&browser_log).unwrap_or_default();
    let log_tail: Vec<&str> = log.lines().rev().take(15).collect();
    seen.push(format!("stderr: {stderr}"));
    seen.push(format!(
        "chromium log (last lines, newest first): {log_tail:?}"
    ));
    let text = seen.join("\n");
    result.with_context(|| format!("driver said:\n{text}"))?;
    ensure!(
        matches!(status, Ok(Ok(ref st)) if st.success()),
        "driver: {status:?}\n{text}"
    );
    let order: Vec<&str> = seen
        .iter()
        .map(String::as_str)
        .filter(|l| ["step running", "step completed", "snapshot ok"].contains(l))
        .collect();
    ensure!(
        order == ["step running", "step completed", "snapshot ok"],
        "the page did not show the step run then complete live:\n{text}"
    );

    let png = std::fs::read(&screenshot)
        .with_context(|| format!("no screenshot at {}", screenshot.display()))?;
    ensure!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "the screenshot is not a picture of the page ({} bytes)",
        png.len()
    );

    // No secret reaches the browser: not in the page, not in the snapshot; and a page that
    // is not this dashboard's (another host name pointed at it) is refused.
    let token = stack.session_record(s).await?.token;
    let page = std::fs::read_to_string(&html)?;
    let (code, snapshot) = get_as(port, &format!("127.0.0.1:{port}"), "/snapshot").await?;
    ensure!(code == 200, "/snapshot: {code} {snapshot}");
    for (what, body) in [("the page", &page), ("/snapshot", &snapshot)] {
        ensure!(!body.contains(&token), "{what} shows the session's token");
        ensure!(
            !body.contains(password),
            "{what} shows the observer's password"
        );
    }
    for field in ["\"token\"", "\"argv\"", "\"messages\""] {
        ensure!(!snapshot.contains(field), "/snapshot sends {field}");
    }
    ensure!(
        snapshot.contains(s.as_str()) && snapshot.contains("\"build\""),
        "the snapshot lacks the session or the step: {snapshot}"
    );
    let (code, body) = get(port, "/snapshot").await?;
    ensure!(code == 403, "a foreign Host header got {code}: {body}");
    Ok(())
}
