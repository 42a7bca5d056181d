//! The NATS server's configuration, written from the permission table in [`crate::permissions`]
//! (so it cannot drift from the subjects the code uses): one user per role and per host, the
//! auth callout that issues agents' identities, and the system account's revoker.
//! `turnstile admin nats-config` prints it (`deploy/nats-server.conf` is its output),
//! `turnstile dev` and the benchmark run on it.

use crate::ids::HostName;
use crate::permissions::{Grant, Role, ACCOUNT, SYSTEM_ACCOUNT};

/// Where the server listens and what it is called.
pub struct ServerSettings {
    pub name: String,
    pub listen: String,
    /// HTTP monitoring (`/varz`, `/jsz` ...), if any.
    pub http: Option<String>,
    /// A JetStream cluster this server is one node of, if any.
    pub cluster: Option<ClusterSettings>,
}

/// The `cluster` block: every node of a cluster runs the same file, each with its own
/// `server_name` given on its command line (`-n`).
pub struct ClusterSettings {
    pub name: String,
    pub listen: String,
    /// Every node's route URL (`nats://host:6222`), its own included.
    pub routes: Vec<String>,
}

/// A user outside the deployment's roles (the benchmark's raw JetStream floor client).
pub struct ExtraUser {
    pub user: String,
    pub password_var: String,
    pub purpose: String,
    pub grant: Grant,
}

/// The whole configuration for a deployment whose transport agents run on `hosts`.
pub fn render(settings: &ServerSettings, hosts: &[HostName]) -> String {
    render_with(settings, hosts, &[])
}

/// Like [`render`], with users of the deployment's account besides its roles.
pub fn render_with(settings: &ServerSettings, hosts: &[HostName], extra: &[ExtraUser]) -> String {
    let roles = Role::all(hosts);
    let mut host_args: String = hosts.iter().map(|h| format!(" --host {h}")).collect();
    if let Some(c) = &settings.cluster {
        host_args.push_str(&format!(" --cluster-name {}", c.name));
        for r in &c.routes {
            host_args.push_str(&format!(" --route {r}"));
        }
    }
    let vars: Vec<String> = roles
        .iter()
        .map(Role::password_var)
        .chain(extra.iter().map(|e| e.password_var.clone()))
        .collect();
    let mut out = format!(
        "# nats-server configuration for a Turnstile deployment (nats-server 2.11 or newer).\n\
         # Written by `turnstile admin nats-config{host_args}`: do not edit; run it again for\n\
         # other hosts. Permissions come from shared/src/permissions.rs, subject names from\n\
         # shared/src/subjects.rs; docs/security.md explains them.\n\
         #\n\
         # The nats-server process's environment holds each user's password and the auth\n\
         # callout issuer (a `$NAME` not defined here is read from the environment; start each\n\
         # password with a letter: a value starting with a digit is read as a number):\n\
         {}\n\
         #   TS_AUTH_ISSUER: the public key printed by\n\
         #     `turnstile admin issuer --seed-file issuer.nk`; the broker signs with the seed.\n\
         # Services connect with TURNSTILE_NATS_URL=nats://<user>:<password>@<host>:4222.\n\
         #\n\
         # Agents have no user here. An agent (or a step's process) connects with its session\n\
         # (or step) id as user and its token as password; everyone not in `auth_users` goes\n\
         # to the auth callout, which the notification-broker answers with an identity that may\n\
         # only send requests on that session's own step and exec subjects.\n\
         # The JetStream store directory is given on the command line (`-sd DIR`).\n\n\
         server_name: {}\n\
         listen: {}\n",
        wrap(&vars.join(", "), "#   "),
        settings.name,
        settings.listen,
    );
    if let Some(http) = &settings.http {
        out.push_str(&format!(
            "# HTTP monitoring; keep it off the public network.\nhttp: {http}\n"
        ));
    }
    if let Some(c) = &settings.cluster {
        out.push_str(&format!(
            "\n# One node of the JetStream cluster {name}: every node runs this file, each with its\n\
             # own server name on its command line (`-n NAME`). Keep the route port off public\n\
             # networks: routes carry no credentials here.\n\
             cluster {{\n  name: {name}\n  listen: {listen}\n  routes: {routes}\n}}\n",
            name = c.name,
            listen = c.listen,
            routes = list(&c.routes, 4),
        ));
    }
    let users: Vec<String> = roles
        .iter()
        .map(Role::user)
        .chain(extra.iter().map(|e| e.user.clone()))
        .collect();
    out.push_str(&format!(
        "\n# The system account: the broker's `revoker` ends a stopped session's connections.\n\
         system_account: {SYSTEM_ACCOUNT}\n\n\
         authorization {{\n  auth_callout {{\n\
         \x20   # The account public key (A...) whose seed the notification-broker signs with.\n\
         \x20   issuer: $TS_AUTH_ISSUER\n\
         \x20   # Callout requests go to $SYS.REQ.USER.AUTH in this account; agents land in it.\n\
         \x20   account: {ACCOUNT}\n\
         \x20   # Checked against this file; everyone else goes to the callout.\n\
         \x20   auth_users: [\n{}\n    ]\n  }}\n}}\n\n\
         jetstream {{\n  # Every stream and bucket is file-backed; the store is `-sd DIR`.\n{}}}\n\n\
         accounts {{\n",
        wrap(&users.join(", "), "      "),
        if settings.cluster.is_some() {
            "  # A cluster syncs every write to disk before acknowledging it: the default\n  \
             # interval loses acknowledged writes when a machine loses power (docs/deploy.md).\n  \
             sync_interval: always\n"
        } else {
            ""
        }
    ));
    for account in [ACCOUNT, SYSTEM_ACCOUNT] {
        out.push_str(&format!("  {account} {{\n"));
        if account == ACCOUNT {
            out.push_str("    jetstream: enabled\n");
        }
        out.push_str("    users: [\n");
        for role in roles.iter().filter(|r| r.account() == account) {
            out.push_str(&user(
                &role.user(),
                &role.purpose(),
                &role.password_var(),
                role.grant(),
            ));
        }
        if account == ACCOUNT {
            for e in extra {
                out.push_str(&user(&e.user, &e.purpose, &e.password_var, e.grant.clone()));
            }
        }
        out.push_str("    ]\n  }\n");
    }
    out.push_str("}\n");
    out
}

fn user(name: &str, purpose: &str, password_var: &str, grant: Grant) -> String {
    let Grant {
        publish,
        publish_deny,
        subscribe,
    } = grant;
    let mut publish_block = String::new();
    if !publish.is_empty() {
        publish_block.push_str(&format!("            allow: {}\n", list(&publish, 14)));
    }
    if !publish_deny.is_empty() {
        publish_block.push_str(&format!("            deny: {}\n", list(&publish_deny, 14)));
    }
    format!(
        "      # {}: {}\n      {{\n        user: {}\n        password: ${}\n        permissions: {{\n          publish: {{\n{publish_block}          }}\n          subscribe: {{\n            allow: {}\n          }}\n        }}\n      }}\n",
        name,
        wrap(purpose, "      # ").trim_start_matches("      # "),
        name,
        password_var,
        list(&subscribe, 14),
    )
}

/// A JSON array of strings, one per line beyond the first few.
fn list(items: &[String], indent: usize) -> String {
    let quoted: Vec<String> = items
        .iter()
        .map(|s| serde_json::to_string(s).unwrap_or_default())
        .collect();
    if quoted.len() <= 2 {
        return format!("[{}]", quoted.join(", "));
    }
    let pad = " ".repeat(indent);
    format!(
        "[\n{}\n{}]",
        quoted
            .iter()
            .map(|q| format!("{pad}{q}"))
            .collect::<Vec<_>>()
            .join(",\n"),
        " ".repeat(indent - 2)
    )
}

/// Wraps words at 96 columns, each line starting with `prefix`.
fn wrap(text: &str, prefix: &str) -> String {
    let mut lines = vec![String::new()];
    for word in text.split_whitespace() {
        let line = lines.last_mut().map_or(0, |l| l.len());
        if line > 0 && prefix.len() + line + 1 + word.len() > 96 {
            lines.push(String::new());
        }
        if let Some(l) = lines.last_mut() {
            if !l.is_empty() {
                l.push(' ');
            }
            l.push_str(word);
        }
    }
    lines
        .iter()
        .map(|l| format!("{prefix}{l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_role_and_host_has_a_user_and_its_password_variable() {
        let hosts: Vec<HostName> = vec!["h1".parse().unwrap(), "build-2".parse().unwrap()];
        let text = render(
            &ServerSettings {
                name: "n".into(),
                listen: "127.0.0.1:4222".into(),
                http: None,
                cluster: None,
            },
            &hosts,
        );
        for role in Role::all(&hosts) {
            assert!(
                text.contains(&format!("user: {}\n", role.user())),
                "{role:?}"
            );
            assert!(text.contains(&format!("${}\n", role.password_var())));
        }
        assert!(text.contains("transport-build-2"));
        assert!(!text.contains("http:"));
    }
}
