//! The benchmark binary, run small: `turnstile-bench lanes` and `schedules` start their own
//! nats-server and services, and print every figure the README quotes, beside the floor of
//! the same run. Checked for completeness and consistency, never for speed (speed is what
//! the figures are for, on a quiet machine).

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use serde_json::Value;

/// Runs `turnstile-bench ARGS` to its end (bounded) and returns the JSON it printed.
async fn bench(args: &[&str]) -> Result<Value> {
    let bin = turnstile_tests::bin_path("turnstile-bench")?;
    let run = tokio::process::Command::new(&bin)
        .args(args)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(180), run)
        .await
        .with_context(|| format!("turnstile-bench {args:?} still running after 180 s"))??;
    ensure!(
        out.status.success(),
        "turnstile-bench {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).context("turnstile-bench printed no JSON")
}

/// A latency summary with `samples` samples, each figure positive and p50 <= p99.
fn summary(v: &Value, what: &str, samples: u64) -> Result<f64> {
    let s = &v[what];
    ensure!(s["samples"].as_u64() == Some(samples), "{what}: {s}");
    let p50 = s["p50_us"].as_f64().context(format!("{what}.p50_us"))?;
    let p99 = s["p99_us"].as_f64().context(format!("{what}.p99_us"))?;
    ensure!(p50 > 0.0 && p50 <= p99, "{what}: {s}");
    Ok(p50)
}

/// `lanes`: the floor, the hand-off, throughput, and the completion path to dispatch and to
/// the transport's write of the turn running, each with its ratio to the floor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lanes_benchmark_prints_each_figure_beside_its_floor() -> Result<()> {
    // 20 turns on one session (19 hand-offs, the first 10 not counted), 2 on each of 2
    // sessions, 25 completions after the warm-up.
    let out = bench(&["lanes", "20", "2", "2", "25"]).await?;
    let floor = summary(&out, "jetstream_floor", 2000)?;
    let handoff = summary(&out, "lane_handoff", 9)?;
    let completion = summary(&out, "completion_to_agent", 25)?;
    let running = summary(&out["completion_to_agent"], "to_running", 25)?;
    for (ratio, p50) in [
        ("handoff_over_floor", handoff),
        ("completion_over_floor", completion),
        ("completion_to_running_over_floor", running),
    ] {
        let r = out[ratio]["p50"].as_f64().context(ratio)?;
        ensure!(
            (r - p50 / floor).abs() < 0.01 + r * 0.01,
            "{ratio} {r} is not {p50} / {floor}"
        );
    }
    let idle_floor = summary(&out, "jetstream_floor_after_idle", 300)?;
    let r = out["completion_over_floor_after_idle"]["p50"]
        .as_f64()
        .context("completion_over_floor_after_idle")?;
    ensure!(
        (r - completion / idle_floor).abs() < 0.01 + r * 0.01,
        "completion_over_floor_after_idle {r} is not {completion} / {idle_floor}"
    );
    // Each path beside the floor measured while it ran: 500 round trips before and after the
    // hand-off's turns; a block of 50 before every 10 completion samples (3 for 25).
    for (ratio, path, floor, samples) in [
        (
            "handoff_over_floor_beside",
            handoff,
            "jetstream_floor_beside_handoff",
            1000,
        ),
        (
            "completion_over_floor_beside",
            completion,
            "jetstream_floor_beside_completion",
            150,
        ),
    ] {
        let beside = summary(&out, floor, samples)?;
        let r = out[ratio]["p50"].as_f64().context(ratio)?;
        ensure!(
            (r - path / beside).abs() < 0.01 + r * 0.01,
            "{ratio} {r} is not {path} / {beside}"
        );
    }
    let stages = &out["completion_to_agent"]["stages_p50_us"];
    for stage in [
        "report_to_recorded_end",
        "recorded_end_to_delivery_item",
        "delivery_item_to_dispatch",
    ] {
        ensure!(stages[stage].as_f64().is_some(), "stage {stage}: {stages}");
    }
    // The hand-off split into stages over the same 9 hand-offs, each stage a time that
    // passed (the clocks are one machine's).
    let stages = &out["handoff_stages_p50_us"];
    ensure!(stages["hand_offs"] == 9, "hand-off stages over {stages}");
    for stage in [
        "end_to_outcome_event",
        "outcome_event_to_next_started",
        "next_started_to_typed",
    ] {
        ensure!(
            stages[stage].as_f64().is_some_and(|us| us > 0.0),
            "stage {stage}: {stages}"
        );
    }
    ensure!(
        out["throughput"]["turns"].as_u64() == Some(4)
            && out["throughput"]["turns_per_sec"].as_f64() > Some(0.0),
        "{}",
        out["throughput"]
    );
    Ok(())
}

/// `schedules`: every schedule due in the same second fires once in each of two slots,
/// none skipped or missed, with its drift measured from the slot records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schedules_benchmark_fires_every_slot_and_measures_its_drift() -> Result<()> {
    let out = bench(&["schedules", "20"]).await?;
    summary(&out, "jetstream_floor", 2000)?;
    summary(&out, "slot_claim_alone", 1000)?;
    let slots = out["slots"].as_array().context("slots")?;
    ensure!(slots.len() == 2, "{slots:?}");
    for slot in slots {
        ensure!(
            slot["fired"].as_u64() == Some(20)
                && slot["skipped"].as_u64() == Some(0)
                && slot["missed"].as_u64() == Some(0)
                && slot["runs_done"].as_u64() == Some(20),
            "{slot}"
        );
        summary(slot, "fire_drift", 20)?;
        summary(slot, "run_queued_drift", 20)?;
    }
    Ok(())
}

/// A fault campaign stopped by SIGTERM halfway removes what it set up (its cluster's network
/// namespaces and bridge, its store mounts, every process it started) and exits non-zero
/// naming the signal: a stopped campaign leaves the machine as it found it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_campaign_stopped_by_sigterm_removes_its_network_mounts_and_processes() -> Result<()> {
    let bin = turnstile_tests::bin_path("turnstile-bench")?;
    let campaign = tokio::process::Command::new(&bin)
        .args(["chaos", "--seed", "1", "--minutes", "5", "--replicas", "3"])
        // The services' log filter (a replay read closely sets it): warnings only here.
        .env("TURNSTILE_CHAOS_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let pid = campaign.id().context("the campaign's pid")?;
    let (bridge, dir_mark) = (format!("tsc{pid}"), format!("ts-chaos-{pid}-"));
    let namespaces = || {
        let out = std::process::Command::new("ip")
            .args(["netns", "list"])
            .output();
        out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with(&format!("{bridge}n")))
            .count()
    };
    let mounts = || {
        std::fs::read_to_string("/proc/mounts")
            .unwrap_or_default()
            .matches(&dir_mark)
            .count()
    };
    // Processes of the campaign: their command lines or their output name its directory.
    let processes = || {
        let mut n = 0;
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let output = std::fs::read_link(entry.path().join("fd/1")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&dir_mark)
                || output.to_string_lossy().contains(&dir_mark)
            {
                n += 1;
            }
        }
        n
    };
    // Up: three nodes in namespaces on their own disks, and the services running.
    turnstile_tests::wait_until(
        "the campaign's cluster and services",
        Duration::from_secs(90),
        || async { Ok((namespaces() == 3 && mounts() == 3 && processes() >= 8).then_some(())) },
    )
    .await?;
    let raw = i32::try_from(pid)?;
    let target = rustix::process::Pid::from_raw(raw).context("pid")?;
    rustix::process::kill_process(target, rustix::process::Signal::TERM)?;
    let out = tokio::time::timeout(Duration::from_secs(60), campaign.wait_with_output())
        .await
        .context("the campaign did not exit within 60 s of SIGTERM")??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "exited 0 when stopped: {stderr}");
    ensure!(stderr.contains("stopped by SIGTERM"), "{stderr}");
    ensure!(namespaces() == 0, "namespaces left: {stderr}");
    let links = std::process::Command::new("ip")
        .args(["-o", "link", "show"])
        .output()?;
    ensure!(
        !String::from_utf8_lossy(&links.stdout).contains(&format!(" {bridge}:")),
        "bridge {bridge} left"
    );
    ensure!(mounts() == 0, "mounts left");
    // Its directory is kept and named; the services logged at the filter given.
    let kept = stderr
        .lines()
        .find_map(|l| l.split("logs in ").nth(1))
        .map(|d| std::path::PathBuf::from(d.trim()))
        .context("the kept directory is named")?;
    let lane_log = std::fs::read_to_string(kept.join("lane-a.log"))?;
    let _ = std::fs::remove_dir_all(&kept);
    ensure!(lane_log.contains("=== spawn"), "{lane_log}");
    ensure!(
        !lane_log.contains(" INFO "),
        "TURNSTILE_CHAOS_LOG=warn, yet the lane logged at info: {lane_log}"
    );
    turnstile_tests::wait_until(
        "every process of the campaign gone",
        Duration::from_secs(10),
        || async { Ok((processes() == 0).then_some(())) },
    )
    .await?;
    Ok(())
}
