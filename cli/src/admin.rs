//! `turnstile admin provision`: creates (or brings up to date) every stream and bucket, run
//! once per deployment with an identity that may manage streams. The services only bind the
//! topology at start, so their own identities need no stream or bucket create, update or
//! delete rights. `turnstile admin issuer`: the account key that signs agents' identities
//! (the server's auth callout issuer, the broker's signing seed).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Subcommand;
use turnstile_shared::config::TopologyArgs;
use turnstile_shared::ids::HostName;
use turnstile_shared::subjects;

#[derive(Subcommand)]
pub enum AdminCommand {
    /// Create or update every stream and KV bucket (idempotent). The hosts bucket's TTL is
    /// `--host-ttl`: give the same timings as the services.
    Provision {
        #[command(flatten)]
        topology: TopologyArgs,
        #[arg(long)]
        json: bool,
    },
    /// Make the account key that signs agents' NATS identities: its seed goes to
    /// `--seed-file` (mode 0600; an existing file is kept and read), its public key is printed.
    /// The public key is the `issuer` of the server's auth callout (`TS_AUTH_ISSUER` in
    /// deploy/nats-server.conf); the notification-broker signs with the seed
    /// (`TURNSTILE_AUTH_ISSUER_SEED_FILE`).
    Issuer {
        #[arg(long)]
        seed_file: PathBuf,
    },
    /// Print the NATS server's configuration: a user per role and per transport host, each
    /// allowed exactly its subjects, and the auth callout that issues agents' identities.
    NatsConfig {
        /// A host whose transport agent joins (repeat for each).
        #[arg(long = "host")]
        hosts: Vec<HostName>,
        #[arg(long, default_value = "turnstile-nats")]
        name: String,
        #[arg(long, default_value = "0.0.0.0:4222")]
        listen: String,
        /// HTTP monitoring address; `none` for none.
        #[arg(long, default_value = "0.0.0.0:8222")]
        http: String,
        /// Make it one node's config of a JetStream cluster of this name (with `--route`).
        #[arg(long, requires = "routes")]
        cluster_name: Option<String>,
        #[arg(long, default_value = "0.0.0.0:6222")]
        cluster_listen: String,
        /// Every node's route URL, e.g. `nats://nats-2:6222` (repeat for each).
        #[arg(long = "route")]
        routes: Vec<String>,
    },
}

pub async fn run(url: &str, cmd: AdminCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        AdminCommand::Provision { topology, json } => provision(url, topology, json).await,
        AdminCommand::Issuer { seed_file } => {
            println!("{}", issuer(&seed_file)?);
            Ok(ExitCode::SUCCESS)
        }
        AdminCommand::NatsConfig {
            hosts,
            name,
            listen,
            http,
            cluster_name,
            cluster_listen,
            routes,
        } => {
            let settings = turnstile_shared::server_config::ServerSettings {
                name,
                listen,
                http: (http != "none").then_some(http),
                cluster: cluster_name.map(|name| {
                    turnstile_shared::server_config::ClusterSettings {
                        name,
                        listen: cluster_listen,
                        routes,
                    }
                }),
            };
            print!(
                "{}",
                turnstile_shared::server_config::render(&settings, &hosts)
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The issuer's public key, from `path` (made there first if it does not exist).
pub fn issuer(path: &Path) -> anyhow::Result<String> {
    if path.exists() {
        let seed =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        let key = turnstile_notification_broker::account_key(&seed)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        return Ok(key.public_key());
    }
    let key = nkeys::KeyPair::new_account();
    let seed = key.seed().context("encode the new seed")?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    f.write_all(seed.as_bytes())
        .and_then(|()| f.sync_all())
        .with_context(|| format!("write {}", path.display()))?;
    Ok(key.public_key())
}

async fn provision(url: &str, topology: TopologyArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = turnstile_shared::config::connect_once(url, "turnstile-admin").await?;
    let js = async_nats::jetstream::new(client);
    turnstile_shared::topology::provision(&js, &topology.to_config()).await?;
    let streams = subjects::ALL_STREAMS;
    let buckets = subjects::ALL_BUCKETS;
    if json {
        println!(
            "{}",
            serde_json::json!({ "streams": streams, "buckets": buckets })
        );
    } else {
        println!(
            "provisioned {} streams ({}) and {} buckets ({})",
            streams.len(),
            streams.join(", "),
            buckets.len(),
            buckets.join(", ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_issuer_is_made_once_privately_and_read_back() {
        let dir = std::env::temp_dir().join(format!("ts-issuer-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("issuer.nk");
        let public = issuer(&path).unwrap();
        assert!(public.starts_with('A'), "{public}");
        assert_eq!(issuer(&path).unwrap(), public, "kept, not replaced");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(&path, nkeys::KeyPair::new_user().seed().unwrap()).unwrap();
        assert!(issuer(&path)
            .unwrap_err()
            .to_string()
            .contains("not an account"));
        std::fs::write(&path, "nonsense").unwrap();
        assert!(issuer(&path).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
