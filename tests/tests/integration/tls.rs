//! TLS (security.md): with `TURNSTILE_TLS_CA` (and a client certificate and key for servers
//! that verify clients) every service, the CLI and the agents' tools connect over TLS. The
//! certificates are made inside the test with `openssl`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::config::{with_tls, TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV};

use crate::stack::{report, Stack};

pub struct Files {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl Files {
    /// The client side as `TURNSTILE_TLS_*` settings.
    pub fn client_env(&self) -> Vec<(&'static str, String)> {
        let s = |p: &PathBuf| p.to_string_lossy().into_owned();
        vec![
            (TLS_CA_ENV, s(&self.ca)),
            (TLS_CERT_ENV, s(&self.client_cert)),
            (TLS_KEY_ENV, s(&self.client_key)),
        ]
    }
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("run openssl (scripts/install-nats-server.sh installs it)")?;
    ensure!(
        out.status.success(),
        "openssl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, all P-256, valid a day.
pub fn make_certificates(dir: &Path) -> Result<Files> {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend(["-keyout", "ca.key", "-out", "ca.pem", "-days", "1"]);
    ca.extend(["-subj", "/CN=turnstile test CA"]);
    openssl(dir, &ca)?;
    for (name, cn, ext) in [
        (
            "server",
            "127.0.0.1",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        ),
        (
            "client",
            "turnstile-client",
            "extendedKeyUsage=clientAuth\n",
        ),
    ] {
        std::fs::write(dir.join(format!("{name}.ext")), ext)?;
        let (key, csr, pem, extf) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
            format!("{name}.ext"),
        );
        let subj = format!("/CN={cn}");
        let mut req = vec!["req"];
        req.extend(ec);
        req.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
        openssl(dir, &req)?;
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "1",
                "-extfile",
                &extf,
            ],
        )?;
    }
    Ok(Files {
        ca: dir.join("ca.pem"),
        server_cert: dir.join("server.pem"),
        server_key: dir.join("server.key"),
        client_cert: dir.join("client.pem"),
        client_key: dir.join("client.key"),
    })
}

/// A server that requires TLS and verifies client certificates against the CA.
pub fn server_config(f: &Files) -> String {
    format!(
        "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: true\n}}\n",
        f.server_cert, f.server_key, f.ca
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_component_connects_over_tls_and_plain_clients_are_refused() -> Result<()> {
    let mut stack = Stack::start_tls(&["a"], &["h1"]).await?;
    let r = over_tls(&mut stack).await;
    report(&stack, r)
}

async fn over_tls(stack: &mut Stack) -> Result<()> {
    // A turn whose agent starts a step with its tools (TLS settings from its env file), and
    // the step's result handed back.
    let s = stack.create_session("tls", None).await?;
    stack.turn_with_a_step_handed_back(&s).await?;
    // An agent launched with an MCP config (claude) gets the TLS settings there too, not only
    // through its terminal's environment.
    let mcp = stack
        .dir
        .path()
        .join(format!("host-h1/sessions/{s}.mcp.json"));
    let mcp: serde_json::Value = serde_json::from_slice(&std::fs::read(&mcp)?)?;
    let env = &mcp["mcpServers"]["turnstile"]["env"];
    ensure!(
        env[TLS_CA_ENV].as_str() == stack.tls_ca().as_deref(),
        "the agent's MCP config has no TLS CA: {env}"
    );

    let connect = |opts: async_nats::ConnectOptions| {
        let url = stack.nats.url();
        async move {
            tokio::time::timeout(
                Duration::from_secs(10),
                opts.connection_timeout(Duration::from_secs(3)).connect(url),
            )
            .await
        }
    };
    // With the operator's valid user and password, so TLS is the only reason to refuse.
    let user = || {
        let pw = stack.password("cli").unwrap_or_default();
        async_nats::ConnectOptions::with_user_and_password("cli".into(), pw)
    };
    let plain = connect(user()).await;
    ensure!(
        !matches!(plain, Ok(Ok(_))),
        "a client without TLS settings connected"
    );
    let ca_only: Vec<(&'static str, String)> = stack_ca(stack)?;
    let anonymous = connect(with_tls(user(), &ca_only)).await;
    ensure!(
        !matches!(anonymous, Ok(Ok(c)) if c.flush().await.is_ok()),
        "a client without a certificate connected to a server that verifies clients"
    );
    Ok(())
}

/// The stack's CA alone (no client certificate).
fn stack_ca(stack: &Stack) -> Result<Vec<(&'static str, String)>> {
    let ca = stack
        .tls_ca()
        .context("this stack has no TLS certificates")?;
    Ok(vec![(TLS_CA_ENV, ca)])
}
