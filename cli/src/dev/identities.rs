//! The identities of `turnstile dev`: the same accounts as a deployment (a user per role, the
//! auth callout for agents), with passwords and the callout's signing key generated once into
//! the data dir and kept there (mode 0600), and the server config written from the same
//! permission table as `turnstile admin nats-config`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use turnstile_shared::ids::HostName;
use turnstile_shared::permissions::Role;

use turnstile_shared::server_config::{render, ServerSettings};

/// Everything the local deployment's processes need to connect as themselves.
pub struct Identities {
    /// Each role's user and password.
    passwords: BTreeMap<String, String>,
    /// The server config and the environment its `$VARIABLES` come from.
    pub config: PathBuf,
    pub server_env: Vec<(String, String)>,
    /// The callout issuer's seed, for the broker.
    pub issuer_seed: String,
    /// The operator's URL and where it is written for other shells.
    pub operator_env: PathBuf,
    port: u16,
}

impl Identities {
    /// Loads (or makes, on first run) the identities under `data_dir` for `host`.
    pub fn load(data_dir: &Path, port: u16, host: &HostName) -> anyhow::Result<Self> {
        let dir = data_dir.join("identities");
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let hosts = [host.clone()];
        let roles = Role::all(&hosts);
        let file = dir.join("passwords.json");
        let mut passwords: BTreeMap<String, String> = match std::fs::read(&file) {
            Ok(b) => serde_json::from_slice(&b)
                .with_context(|| format!("{} is not a password file", file.display()))?,
            Err(_) => BTreeMap::new(),
        };
        let before = passwords.len();
        for role in &roles {
            passwords
                .entry(role.user())
                .or_insert_with(turnstile_shared::ids::new_secret);
        }
        if passwords.len() != before {
            write_private(&file, &serde_json::to_vec_pretty(&passwords)?)?;
        }
        let seed_file = dir.join("issuer.nk");
        let issuer = crate::admin::issuer(&seed_file)?;
        let issuer_seed = std::fs::read_to_string(&seed_file)?.trim().to_string();
        let config = dir.join("nats-server.conf");
        let settings = ServerSettings {
            name: "turnstile-dev".into(),
            listen: format!("127.0.0.1:{port}"),
            http: None,
            cluster: None,
        };
        std::fs::write(&config, render(&settings, &hosts))
            .with_context(|| format!("write {}", config.display()))?;
        let mut server_env: Vec<(String, String)> = roles
            .iter()
            .map(|r| (r.password_var(), passwords[&r.user()].clone()))
            .collect();
        server_env.push(("TS_AUTH_ISSUER".into(), issuer));
        let operator_env = dir.join("operator.env");
        let me = Self {
            passwords,
            config,
            server_env,
            issuer_seed,
            operator_env,
            port,
        };
        write_private(
            &me.operator_env,
            format!("TURNSTILE_NATS_URL={}\n", me.url(&Role::Cli)?).as_bytes(),
        )?;
        Ok(me)
    }

    /// `nats://<user>:<password>@127.0.0.1:<port>` for `role`.
    pub fn url(&self, role: &Role) -> anyhow::Result<String> {
        let user = role.user();
        let pw = self
            .passwords
            .get(&user)
            .with_context(|| format!("no password for {user}"))?;
        Ok(format!("nats://{user}:{pw}@127.0.0.1:{}", self.port))
    }
}

fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    turnstile_shared::private_file::write(path, bytes)
        .with_context(|| format!("write {}", path.display()))
}
