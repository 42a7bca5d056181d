//! Every API is a NATS micro service that any NATS client can find: a Python client (nats-py,
//! not async-nats) on the CLI's identity sends `$SRV.PING` and `$SRV.INFO`, and finds the
//! three services with their descriptions, versions and each endpoint's subject and metadata
//! (its wire types and where they are documented).

use anyhow::{ensure, Context, Result};
use turnstile_shared::subjects::api as subj;
use turnstile_tests::workspace_root;

use crate::stack::{report, Stack};

/// The services and endpoints a client must find.
const EXPECTED: [(&str, &[&str]); 3] = [
    (
        subj::SESSION_SERVICE,
        &[
            "create", "send", "stop", "list", "show", "hosts", "start", "cancel", "retry",
        ],
    ),
    (
        subj::SCHEDULER_SERVICE,
        &[
            "add", "list", "show", "pause", "resume", "trigger", "backfill", "delete",
        ],
    ),
    (
        subj::BROKER_SERVICE,
        &["start", "report", "status", "list", "tree", "cancel"],
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_nats_client_finds_every_api_with_its_endpoints() -> Result<()> {
    let python = crate::mcp::python()?;
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = discover(&mut stack, &python).await;
    report(&stack, r)
}

async fn discover(stack: &mut Stack, python: &str) -> Result<()> {
    let script = workspace_root().join("tests").join("srv_discovery.py");
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg(&script)
        .env("TURNSTILE_NATS_URL", stack.operator_url());
    let found = crate::mcp::json_output(cmd, "the discovery client").await?;

    let pings = found["pings"].as_array().context("pings")?;
    for (name, verbs) in EXPECTED {
        let ping = pings
            .iter()
            .find(|p| p["name"] == name)
            .with_context(|| format!("{name} did not answer $SRV.PING: {pings:?}"))?;
        ensure!(
            ping["version"] == env!("CARGO_PKG_VERSION") && ping["id"].as_str().is_some(),
            "{name}'s ping: {ping}"
        );
        let infos = found["infos"][name].as_array().context("infos")?;
        let info = infos
            .first()
            .with_context(|| format!("{name} did not answer $SRV.INFO"))?;
        ensure!(
            info["description"]
                .as_str()
                .is_some_and(|d| d.starts_with("Turnstile ")),
            "{name} has no description: {info}"
        );
        let endpoints = info["endpoints"].as_array().context("endpoints")?;
        for verb in verbs {
            let e = endpoints
                .iter()
                .find(|e| e["name"] == *verb)
                .with_context(|| format!("{name} has no endpoint {verb}: {endpoints:?}"))?;
            let subject = e["subject"].as_str().unwrap_or_default();
            ensure!(
                subject.starts_with("ts.api.") && subject.contains(verb),
                "{name}.{verb} subject {subject:?}"
            );
            let meta = &e["metadata"];
            for key in ["request", "reply", "docs"] {
                ensure!(
                    meta[key].as_str().is_some_and(|v| !v.is_empty()),
                    "{name}.{verb} has no {key} in its metadata: {e}"
                );
            }
            ensure!(
                !meta["request"].as_str().unwrap_or_default().contains("::"),
                "{name}.{verb}: a type name with its path: {meta}"
            );
        }
    }
    // Broker endpoints are per principal; their metadata says how to read the subject.
    let broker = &found["infos"][subj::BROKER_SERVICE][0]["endpoints"];
    ensure!(
        broker
            .as_array()
            .is_some_and(|es| es.iter().all(|e| e["metadata"]["principal"].is_string())),
        "broker endpoints without their principal note: {broker}"
    );
    Ok(())
}
