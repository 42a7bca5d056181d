//! Hands a session's credentials to its agent without putting them on any command line (where
//! `ps` would show them): an env file and an MCP config, both readable by this user only, and
//! a launcher that sources the one and `exec`s the agent.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use crate::adapters::SessionSpec;

/// Where a session's files live, under the transport's data dir.
pub struct SessionFiles {
    pub env: PathBuf,
    pub mcp: PathBuf,
}

impl SessionFiles {
    pub fn at(data_dir: &Path, spec: &SessionSpec) -> Self {
        let dir = data_dir.join("sessions");
        Self {
            env: dir.join(format!("{}.env", spec.id)),
            mcp: dir.join(format!("{}.mcp.json", spec.id)),
        }
    }

    /// Writes both files (mode 0600, directory 0700). `turnstile` is the binary whose `mcp`
    /// subcommand the agent's MCP client launches.
    pub fn write(
        &self,
        spec: &SessionSpec,
        nats_url: &str,
        turnstile: &Path,
    ) -> std::io::Result<()> {
        if let Some(dir) = self.env.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
        }
        let mut vars = vec![
            ("TURNSTILE_SESSION", spec.id.to_string()),
            ("TURNSTILE_TOKEN", spec.token.clone()),
            ("TURNSTILE_NATS_URL", nats_url.to_string()),
        ];
        // The agent's tools connect the way this transport does (TLS files, not keys).
        vars.extend(turnstile_shared::config::tls_env());
        let mut env: String = vars
            .iter()
            .map(|(k, v)| format!("{k}={}\n", shell_quote(v)))
            .collect();
        env.push_str(&format!(
            "TURNSTILE_MCP_CONFIG={}\n",
            shell_quote(&self.mcp.to_string_lossy())
        ));
        turnstile_shared::private_file::write(&self.env, env.as_bytes())?;
        let servers: serde_json::Map<String, serde_json::Value> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(v.as_str())))
            .collect();
        let mcp = serde_json::json!({
            "mcpServers": {
                "turnstile": {
                    "command": turnstile.to_string_lossy(),
                    "args": ["mcp"],
                    "env": servers,
                }
            }
        });
        turnstile_shared::private_file::write(&self.mcp, mcp.to_string().as_bytes())
    }

    pub fn remove(&self) {
        let _ = std::fs::remove_file(&self.env);
        let _ = std::fs::remove_file(&self.mcp);
    }

    /// `sh -c 'set -a; . ENV; set +a; exec "$@"' ENV ARGV...`: the agent replaces the shell, so
    /// the pane's process is the agent itself.
    pub fn wrap(&self, argv: Vec<String>) -> Vec<String> {
        let mut out = vec![
            "sh".to_string(),
            "-c".to_string(),
            "set -a; . \"$0\"; set +a; exec \"$@\"".to_string(),
            self.env.to_string_lossy().into_owned(),
        ];
        out.extend(argv);
        out
    }
}

/// Single-quotes a value for `sh`.
fn shell_quote(v: &str) -> String {
    format!("'{}'", v.replace('\'', "'\\''"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn files_are_private_and_the_shell_reads_them_back() {
        let dir = tempfile_dir();
        let spec = SessionSpec {
            id: turnstile_shared::SessionId::new(),
            agent: turnstile_shared::records::AgentKind::Mock,
            cwd: None,
            conversation: None,
            token: "tok_s3cret".into(),
            launch: None,
            ready_timeout: None,
            policy: Default::default(),
        };
        let files = SessionFiles::at(&dir, &spec);
        files
            .write(
                &spec,
                "nats://u:p'w@h:4222",
                Path::new("/usr/bin/turnstile"),
            )
            .expect("write");
        let mode = std::fs::metadata(&files.env)
            .expect("env")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let argv = files.wrap(vec![
            "sh".into(),
            "-c".into(),
            "printf %s \"$TURNSTILE_NATS_URL|$TURNSTILE_TOKEN\"".into(),
        ]);
        assert!(
            !argv.iter().any(|a| a.contains("s3cret")),
            "no secret on the command line"
        );
        let out = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .output()
            .expect("run");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "nats://u:p'w@h:4222|tok_s3cret"
        );
        let mcp: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&files.mcp).expect("mcp")).expect("json");
        assert_eq!(mcp["mcpServers"]["turnstile"]["args"][0], "mcp");
        assert_eq!(
            mcp["mcpServers"]["turnstile"]["env"]["TURNSTILE_TOKEN"],
            "tok_s3cret"
        );
        files.remove();
        assert!(!files.env.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("ts-cred-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&d).expect("dir");
        d
    }
}
