//! `/metrics` on every service's `--http` listener: after a turn whose step is handed back in
//! a delivery, a schedule's slot and a step report with a wrong token, each service's
//! exposition parses as Prometheus text and shows the families of its own work with non-zero
//! values, and no label value is an id (a fleet keeps a fixed number of series).

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

use crate::health::get;
use crate::stack::{report, schedule, Stack};

/// One sample: its labels (`name="value"` pairs) and value.
pub(crate) type Samples = HashMap<String, Vec<(Vec<(String, String)>, f64)>>;

/// Parses the text exposition: `# ...` lines are metadata, every other line is
/// `name{labels} value` or `name value`. Anything else is an error.
fn parse(text: &str) -> Result<Samples> {
    let mut out: Samples = HashMap::new();
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (series, value) = line
            .rsplit_once(' ')
            .with_context(|| format!("no value in {line:?}"))?;
        let value: f64 = value
            .parse()
            .with_context(|| format!("value of {line:?}"))?;
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => {
                let inner = rest
                    .strip_suffix('}')
                    .with_context(|| format!("labels of {line:?}"))?;
                let mut labels = Vec::new();
                for pair in inner.split(',').filter(|p| !p.is_empty()) {
                    let (k, v) = pair
                        .split_once('=')
                        .with_context(|| format!("label {pair:?} in {line:?}"))?;
                    let v = v
                        .strip_prefix('"')
                        .and_then(|v| v.strip_suffix('"'))
                        .with_context(|| format!("unquoted label value in {line:?}"))?;
                    labels.push((k.to_string(), v.to_string()));
                }
                (name, labels)
            }
            None => (series, Vec::new()),
        };
        ensure!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line:?}"
        );
        out.entry(name.to_string())
            .or_default()
            .push((labels, value));
    }
    Ok(out)
}

/// The sum of a family's samples (`name` as exposed, e.g. `..._total`, `..._count`).
fn total(samples: &Samples, name: &str) -> f64 {
    samples
        .get(name)
        .map_or(0.0, |s| s.iter().map(|(_, v)| v).sum())
}

pub(crate) async fn scrape(stack: &Stack, service: &str) -> Result<Samples> {
    let port = *stack
        .http
        .get(service)
        .with_context(|| format!("{service} has no --http port"))?;
    let (status, body) = get(port, "/metrics").await?;
    ensure!(status == 200, "{service} /metrics: {status} {body}");
    ensure!(
        body.ends_with("# EOF\n"),
        "{service}: exposition not terminated"
    );
    let samples = parse(&body).with_context(|| format!("{service}'s exposition"))?;
    for (name, series) in &samples {
        for (labels, _) in series {
            for (k, v) in labels {
                let id_like = ["ses_", "trn_", "run_", "stp_", "exe_", "del_"]
                    .iter()
                    .any(|p| v.starts_with(p));
                ensure!(!id_like, "{service}: {name} has an id as label {k}={v}");
            }
        }
    }
    Ok(samples)
}

/// Every `(service, family)` here must be non-zero after the work this test does.
const OWNED: [(&str, &str); 14] = [
    ("lane-a", "turnstile_lane_queue_depth_count"),
    ("lane-a", "turnstile_turns_started_total"),
    ("lane-a", "turnstile_turns_ended_total"),
    ("lane-a", "turnstile_turn_duration_seconds_count"),
    ("lane-a", "turnstile_handoff_seconds_count"),
    ("lane-a", "turnstile_completions_handed_over_total"),
    ("lane-a", "turnstile_delivery_batch_size_count"),
    ("lane-a", "turnstile_hosts_alive"),
    ("broker-b1", "turnstile_steps_ended_total"),
    ("broker-b1", "turnstile_completions_routed_total"),
    ("broker-b1", "turnstile_auth_refusals_total"),
    ("scheduler-s1", "turnstile_slots_total"),
    ("scheduler-s1", "turnstile_fire_drift_seconds_count"),
    ("transport-h1", "turnstile_terminals_died_total"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_exposes_its_work_as_prometheus_metrics() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = metrics(&mut stack).await;
    report(&stack, r)
}

async fn metrics(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("metrics", None).await?;
    stack.turn_with_a_step_handed_back(&s).await?;
    stack
        .add_schedule(&schedule("metrics-tick", "* * * * * *", &s, &["tick"]))
        .await?;
    stack
        .wait_slots("metrics-tick", 1, Duration::from_secs(30))
        .await?;
    // A report with credentials for no step: refused, and counted.
    let refused = stack.report_with_a_wrong_token().await;
    ensure!(refused.is_err(), "a report without a step was accepted");

    let mut missing = Vec::new();
    // The hosts gauge and the slot counters catch up within a second or two.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        missing.clear();
        for (service, family) in OWNED {
            let samples = scrape(stack, service).await?;
            ensure!(
                samples.contains_key(family),
                "{service} does not expose {family}"
            );
            // A terminal only dies on a tmux host: present, and zero on this mock host.
            if family == "turnstile_terminals_died_total" {
                ensure!(total(&samples, family) == 0.0, "{service}: {family} moved");
                continue;
            }
            if total(&samples, family) <= 0.0 {
                missing.push(format!("{service} {family}"));
            }
        }
        if missing.is_empty() {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("still zero after the run: {missing:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The turn outcome is labelled by its reason code, bounded.
    let lane = scrape(stack, "lane-a").await?;
    let ended = lane
        .get("turnstile_turns_ended_total")
        .context("no turns ended")?;
    ensure!(
        ended.iter().any(|(labels, v)| *v > 0.0
            && labels.contains(&("outcome".to_string(), "completed".to_string()))),
        "no completed turn counted: {ended:?}"
    );
    Ok(())
}

#[test]
fn the_parser_refuses_what_is_not_exposition() {
    assert!(parse("# HELP x y\nx_total{a=\"b\"} 3\ny 1.5\n").is_ok());
    assert!(parse("x_total{a=b} 3\n").is_err());
    assert!(parse("x_total three\n").is_err());
}

/// With two broker replicas, the replica that takes a worker's report records its end and
/// removes the end's message; the other replica, given it first, gives it back for a moment
/// and never records it again: each end is recorded, counted and routed once, not once per
/// replica that saw its message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_brokers_each_reported_end_is_recorded_once() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = two_brokers(&mut stack).await;
    report(&stack, r)
}

async fn two_brokers(stack: &mut Stack) -> Result<()> {
    stack.spawn_broker("b2")?;
    let port = *stack.http.get("broker-b2").context("broker-b2's --http")?;
    turnstile_tests::wait_until("broker b2 ready", Duration::from_secs(20), || async move {
        Ok((get(port, "/readyz").await.ok().map(|(s, _)| s) == Some(200)).then_some(()))
    })
    .await?;
    let s = stack.create_session("two-brokers", None).await?;
    const STEPS: usize = 8;
    for i in 0..STEPS {
        let t = stack
            .send(&s, &format!("!step job-{i} 100ms\n!sleep 400ms"))
            .await?;
        stack.all_complete(std::slice::from_ref(&t)).await?;
        crate::stack::wait_deliveries(stack, &s, i + 1, Duration::from_secs(20)).await?;
    }
    // Every end's message is gone from the ended queue, one way or the other.
    stack.wait_ended_drained().await?;
    let mut ended = 0.0;
    let mut routed = 0.0;
    for broker in ["broker-b1", "broker-b2"] {
        let samples = scrape(stack, broker).await?;
        ended += total(&samples, "turnstile_steps_ended_total");
        routed += total(&samples, "turnstile_completions_routed_total");
    }
    ensure!(
        ended == STEPS as f64 && routed == STEPS as f64,
        "{STEPS} ends recorded {ended} times and routed {routed} times"
    );
    Ok(())
}
