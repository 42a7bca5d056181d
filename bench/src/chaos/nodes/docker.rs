//! The Docker and iproute2 commands the compose nodes are driven by, each bounded, and the
//! sweep of what a campaign no longer running left under Docker.

use std::time::Duration;

use anyhow::{bail, Context, Result};

/// The image docker-compose.yml runs (`NATS_IMAGE`), as scripts/build-images.sh names it.
pub const IMAGE: &str = "turnstile-nats:local";
/// A campaign's compose project is `tschaos<pid>`.
pub const PROJECT_PREFIX: &str = "tschaos";

/// Builds the nats image as scripts/build-images.sh does (deploy/nats.Dockerfile, FROM
/// scratch, the pinned binary) when the engine does not have it.
pub(super) async fn ensure_image() -> Result<()> {
    if docker(&["image", "inspect", IMAGE]).await.is_ok() {
        return Ok(());
    }
    let context = tempfile::tempdir()?;
    let bin = turnstile_tests::nats_server_bin()?;
    std::fs::copy(&bin, context.path().join("nats-server"))
        .with_context(|| format!("copy {}", bin.display()))?;
    std::fs::copy(
        turnstile_tests::workspace_root().join("deploy/nats.Dockerfile"),
        context.path().join("Dockerfile"),
    )
    .context("copy deploy/nats.Dockerfile")?;
    let path = context.path().to_string_lossy().into_owned();
    docker(&["build", "-q", "-t", IMAGE, &path]).await?;
    Ok(())
}

/// Removes the containers and networks of campaigns no longer running; returns what it
/// removed.
pub fn sweep_orphans() -> Vec<String> {
    let dead = |project: &str| {
        project
            .strip_prefix(PROJECT_PREFIX)
            .and_then(|pid| pid.parse::<u32>().ok())
            .is_some_and(|pid| !super::super::net::running(pid))
    };
    let list = |args: &[&str]| -> Vec<String> {
        std::process::Command::new("docker")
            .args(args)
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut removed = Vec::new();
    let label = "{{.Label \"com.docker.compose.project\"}} {{.Names}}";
    for line in list(&["ps", "-a", "--format", label]) {
        let mut words = line.split_whitespace();
        let (Some(project), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        if dead(project) && run_quiet(&["rm", "-f", "-v", name]) {
            removed.push(format!("container {name}"));
        }
    }
    for network in list(&["network", "ls", "--format", "{{.Name}}"]) {
        if network.strip_suffix("_default").is_some_and(&dead)
            && run_quiet(&["network", "rm", &network])
        {
            removed.push(format!("network {network}"));
        }
    }
    // The volumes docker-compose.yml declares, made by `up` for the project.
    let volume_label = "{{.Label \"com.docker.compose.project\"}} {{.Name}}";
    for line in list(&["volume", "ls", "--format", volume_label]) {
        let mut words = line.split_whitespace();
        let (Some(project), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        if dead(project) && run_quiet(&["volume", "rm", name]) {
            removed.push(format!("volume {name}"));
        }
    }
    removed
}

fn run_quiet(args: &[&str]) -> bool {
    std::process::Command::new("docker")
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Whether a Docker engine answers (the Docker tests skip, saying why, where none does).
#[cfg(test)]
pub(super) async fn engine_answers() -> bool {
    let answers = docker(&["info"]).await.is_ok();
    if !answers {
        eprintln!("SKIPPED: no Docker engine answers (docker info failed)");
    }
    answers
}

pub(super) async fn docker(args: &[&str]) -> Result<String> {
    let mut command = tokio::process::Command::new("docker");
    command.args(args);
    output(command, &format!("docker {}", args.join(" "))).await
}

pub(super) async fn ip(args: &[&str]) -> Result<()> {
    ip_out(args).await.map(|_| ())
}

pub(super) async fn ip_out(args: &[&str]) -> Result<String> {
    let mut command = tokio::process::Command::new("ip");
    command.args(args);
    output(command, &format!("ip {}", args.join(" "))).await
}

/// Runs `command` (bounded: 120 s), its stdout on success, its stderr in the error.
pub(super) async fn output(mut command: tokio::process::Command, what: &str) -> Result<String> {
    command.kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .with_context(|| format!("{what}: no answer within 120 s"))?
        .with_context(|| what.to_string())?;
    if !out.status.success() {
        bail!("{what}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dead campaign's containers and network are removed by the sweep; a running one's are
    /// kept. Skips, saying why, where no Docker engine answers.
    #[tokio::test]
    async fn a_dead_campaigns_project_is_swept_and_a_live_ones_kept() -> Result<()> {
        if !engine_answers().await {
            return Ok(());
        }
        ensure_image().await?;
        let mut child = std::process::Command::new("true").spawn()?;
        let dead_pid = child.id();
        child.wait()?;
        // A live "campaign": a process that runs while the sweep does.
        let mut alive = std::process::Command::new("sleep").arg("60").spawn()?;
        let (dead, live) = (
            format!("{PROJECT_PREFIX}{dead_pid}"),
            format!("{PROJECT_PREFIX}{}", alive.id()),
        );
        for project in [&dead, &live] {
            let network = format!("{project}_default");
            docker(&["network", "create", &network]).await?;
            let label = format!("com.docker.compose.project={project}");
            let volume = format!("{project}_nats-data");
            docker(&["volume", "create", "--label", &label, &volume]).await?;
            let name = format!("{project}_nats_1");
            docker(&[
                "create",
                "--label",
                &label,
                "--name",
                &name,
                "--network",
                &network,
                IMAGE,
            ])
            .await?;
        }
        let removed = tokio::task::spawn_blocking(sweep_orphans).await?;
        let names = docker(&["ps", "-a", "--format", "{{.Names}}"]).await?;
        let networks = docker(&["network", "ls", "--format", "{{.Name}}"]).await?;
        // The live one's, removed by hand.
        let _ = docker(&["rm", "-f", &format!("{live}_nats_1")]).await;
        let _ = docker(&["network", "rm", &format!("{live}_default")]).await;
        let volumes = docker(&["volume", "ls", "--format", "{{.Name}}"]).await?;
        let _ = docker(&["volume", "rm", &format!("{live}_nats-data")]).await;
        let _ = alive.kill();
        let _ = alive.wait();
        assert!(
            removed.contains(&format!("container {dead}_nats_1")),
            "{removed:?}"
        );
        assert!(
            removed.contains(&format!("network {dead}_default")),
            "{removed:?}"
        );
        assert!(!names.contains(&format!("{dead}_nats_1")), "{names}");
        assert!(
            removed.contains(&format!("volume {dead}_nats-data")),
            "{removed:?}"
        );
        assert!(
            volumes.contains(&format!("{live}_nats-data")),
            "the live one's kept"
        );
        assert!(!networks.contains(&format!("{dead}_default")), "{networks}");
        assert!(
            names.contains(&format!("{live}_nats_1")),
            "the live one's kept"
        );
        assert!(
            networks.contains(&format!("{live}_default")),
            "the live one's kept"
        );
        Ok(())
    }
}
