//! Settings every binary takes the same way: where NATS is, and the topology timings, from
//! flags or `TURNSTILE_*` environment variables.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::retry::Backoff;
use crate::topology::TopologyConfig;

pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

#[derive(Debug, Clone, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL.
    #[arg(long = "nats", env = "TURNSTILE_NATS_URL", default_value = DEFAULT_NATS_URL, global = true)]
    pub url: String,
}

#[derive(Debug, Clone, clap::Args)]
pub struct TopologyArgs {
    /// Redelivery wait of lane items (progress-acked while a turn runs), e.g. `30s`.
    #[arg(long, env = "TURNSTILE_LANE_ACK_WAIT", default_value = "30s", value_parser = crate::duration::parse_flag)]
    pub lane_ack_wait: Duration,
    /// How long a session-lane replica keeps a lane's pin after it stops pulling.
    #[arg(long, env = "TURNSTILE_LANE_PIN_TTL", default_value = "30s", value_parser = crate::duration::parse_flag)]
    pub lane_pin_ttl: Duration,
    /// Redelivery wait of transport commands.
    #[arg(long, env = "TURNSTILE_TRANSPORT_ACK_WAIT", default_value = "30s", value_parser = crate::duration::parse_flag)]
    pub transport_ack_wait: Duration,
    /// Redelivery wait of the broker's queues (progress-acked while handled): how soon a
    /// killed broker replica's messages go to another.
    #[arg(long, env = "TURNSTILE_SERVICE_ACK_WAIT", default_value = "2s", value_parser = crate::duration::parse_flag)]
    pub service_ack_wait: Duration,
    /// A host that has not heartbeaten for this long counts as gone.
    #[arg(long, env = "TURNSTILE_HOST_TTL", default_value = "15s", value_parser = crate::duration::parse_flag)]
    pub host_ttl: Duration,
    /// Copies of every stream and bucket (provisioning): 1 on a single nats-server, 3 in a
    /// three-node JetStream cluster.
    #[arg(long, env = "TURNSTILE_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=5))]
    pub replicas: u8,
    /// How long finished records (runs, slots, stopped sessions; turns and executions a week
    /// longer) are kept after their last write (provisioning).
    #[arg(long, env = "TURNSTILE_RECORD_RETENTION", default_value = "30days", value_parser = crate::duration::parse_flag)]
    pub record_retention: Duration,
    /// How much longer than runs turns and executions are kept (provisioning): a run's tree
    /// stays whole for its retention if the run lasted less than this.
    #[arg(long, env = "TURNSTILE_TREE_MARGIN", default_value = "7days", value_parser = crate::duration::parse_flag)]
    pub tree_margin: Duration,
    /// How long lifecycle events and dead letters are kept (provisioning).
    #[arg(long, env = "TURNSTILE_EVENTS_MAX_AGE", default_value = "7days", value_parser = crate::duration::parse_flag)]
    pub events_max_age: Duration,
}

impl TopologyArgs {
    pub fn to_config(&self) -> TopologyConfig {
        TopologyConfig {
            lane_ack_wait: self.lane_ack_wait,
            lane_pin_ttl: self.lane_pin_ttl,
            transport_ack_wait: self.transport_ack_wait,
            service_ack_wait: self.service_ack_wait,
            host_ttl: self.host_ttl,
            replicas: usize::from(self.replicas),
            record_retention: self.record_retention,
            tree_margin: self.tree_margin,
            events_max_age: self.events_max_age,
            ..TopologyConfig::default()
        }
    }
}

/// Splits `nats://user:password@host:port` into the address and its credentials: async-nats
/// ignores credentials written into the URL, so they are applied as options instead.
pub fn split_credentials(url: &str) -> (String, Option<(String, String)>) {
    let Some((scheme, rest)) = url.split_once("://") else {
        return (url.to_string(), None);
    };
    let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
    let Some((userinfo, host)) = authority.rsplit_once('@') else {
        return (url.to_string(), None);
    };
    let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    let mut bare = format!("{scheme}://{host}");
    if !path.is_empty() {
        bare = format!("{bare}/{path}");
    }
    (bare, Some((user.to_string(), password.to_string())))
}

/// The servers of a URL that lists several, `nats://a:4222,b:4222,c:4222` (credentials, when
/// given, come first: `nats://user:pw@a:4222,b:4222`): a cluster's nodes to try in turn, so a
/// client's first connection does not depend on one of them. The client learns the rest of the
/// cluster from whichever answers.
pub fn seed_servers(bare: &str) -> Vec<String> {
    let scheme = bare.split_once("://").map_or("nats", |(s, _)| s);
    bare.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            if s.contains("://") {
                s.to_string()
            } else {
                format!("{scheme}://{s}")
            }
        })
        .collect()
}

fn options(url: &str, name: &str) -> (String, async_nats::ConnectOptions) {
    options_or(url, name, None)
}

/// The options every connection takes: the URL's credentials, else `fallback` (user,
/// password); TLS from the environment; a name; permission refusals logged and counted.
pub fn options_or(
    url: &str,
    name: &str,
    fallback: Option<(String, String)>,
) -> (String, async_nats::ConnectOptions) {
    let (bare, creds) = split_credentials(url);
    let opts = match creds.or(fallback) {
        Some((user, password)) => {
            async_nats::ConnectOptions::with_user_and_password(user, password)
        }
        None => async_nats::ConnectOptions::new(),
    };
    let opts = with_tls(opts, &tls_env());
    let who = name.to_string();
    (
        bare,
        opts.name(name)
            .connection_timeout(CONNECT_TIMEOUT)
            .ping_interval(CLIENT_PING)
            .event_callback(move |event| {
                let who = who.clone();
                async move { log_event(&who, event) }
            }),
    )
}

/// How often every connection pings its server. A server cut off by the network closes
/// nothing: the client notices only by unanswered pings (two), so this bounds how long it
/// stays on a partitioned node before moving to another seed: 4-6 s, plus at most
/// [`CONNECT_TIMEOUT`] per unreachable seed tried, inside the host TTL (15 s) that would
/// otherwise fail a transport's turns (async-nats's default is 60 s). The cost is one PING
/// and PONG every 2 s on each connection.
pub const CLIENT_PING: Duration = Duration::from_secs(2);

/// How long one connection attempt (TCP, TLS, the server's INFO) may take before the next
/// seed is tried: a node that is cut off never refuses, it only stays silent.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The CA file that signs the server's certificate: set, every connection requires TLS.
pub const TLS_CA_ENV: &str = "TURNSTILE_TLS_CA";
/// A client certificate and its key, for servers that verify clients.
pub const TLS_CERT_ENV: &str = "TURNSTILE_TLS_CERT";
pub const TLS_KEY_ENV: &str = "TURNSTILE_TLS_KEY";

/// The TLS settings of this process's environment, as (variable, value): what every binary
/// connects with, and what the transport hands on to the agents it launches.
pub fn tls_env() -> Vec<(&'static str, String)> {
    [TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV]
        .into_iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| (k, v)))
        .filter(|(_, v)| !v.is_empty())
        .collect()
}

/// Applies TLS settings: a CA makes TLS required; a certificate and key are presented to a
/// server that verifies clients. A `tls://` URL also requires TLS.
pub fn with_tls(
    mut opts: async_nats::ConnectOptions,
    tls: &[(&'static str, String)],
) -> async_nats::ConnectOptions {
    let get = |k: &str| tls.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
    if let Some(ca) = get(TLS_CA_ENV) {
        opts = opts.add_root_certificates(ca.into()).require_tls(true);
    }
    if let (Some(cert), Some(key)) = (get(TLS_CERT_ENV), get(TLS_KEY_ENV)) {
        opts = opts.add_client_certificate(cert.into(), key.into());
    }
    opts
}

/// Subjects the server refused this process (publish or subscribe) since it started.
static PERMISSION_REFUSALS: AtomicU64 = AtomicU64::new(0);
/// The server's words for the latest refusal (for `/readyz`).
static LAST_REFUSAL: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// The latest permission refusal's text, if any.
pub fn last_permission_refusal() -> Option<String> {
    LAST_REFUSAL.lock().ok().and_then(|l| l.clone())
}

/// How many times the server refused this process a subject: a refusal is a deployment error
/// (its identity lacks a permission it needs), never routine.
pub fn permission_refusals() -> u64 {
    PERMISSION_REFUSALS.load(Ordering::Relaxed)
}

/// Connection events: a permission the server refuses is an error (logged and counted);
/// connection changes are worth an info line; anything else that goes wrong a warning.
fn log_event(who: &str, event: async_nats::Event) {
    match event {
        async_nats::Event::ServerError(e) if is_permission_error(&e.to_string()) => {
            PERMISSION_REFUSALS.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut last) = LAST_REFUSAL.lock() {
                *last = Some(e.to_string());
            }
            tracing::error!(connection = who, error = %e, "NATS refused a permission");
        }
        async_nats::Event::Connected
        | async_nats::Event::Disconnected
        | async_nats::Event::Draining
        | async_nats::Event::Closed => {
            tracing::info!(connection = who, %event, "NATS connection")
        }
        // Other server errors, client errors, slow consumers, lame-duck mode.
        other => tracing::warn!(connection = who, event = %other, "NATS event"),
    }
}

/// The server's permission refusals read `Permissions Violation for Publish to "…"`.
pub fn is_permission_error(text: &str) -> bool {
    text.to_ascii_lowercase().contains("permissions violation")
}

/// For services: reconnects forever, so a NATS restart is a pause, not an outage.
pub async fn connect(
    url: &str,
    name: &str,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    let (bare, opts) = options(url, name);
    opts.retry_on_initial_connect()
        .max_reconnects(None)
        .connect(seed_servers(&bare))
        .await
}

/// For one-shot commands: fails at once when NATS is not there. The error names the server
/// without its credentials.
pub async fn connect_once(url: &str, name: &str) -> Result<async_nats::Client, StartError> {
    let (bare, opts) = options(url, name);
    opts.connect(seed_servers(&bare))
        .await
        .map_err(|source| StartError::Connect { url: bare, source })
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("connect to NATS at {url}: {source}")]
    Connect {
        url: String,
        source: async_nats::ConnectError,
    },
    #[error("stopped while waiting for the topology")]
    Cancelled,
}

/// What every service holds once it has started.
pub struct Connected {
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub buckets: crate::topology::Buckets,
}

/// How a starting service retries binding a topology that is not provisioned yet.
const BIND_RETRY: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));

/// Connects (retrying) and binds the provisioned topology: the common start of every service.
/// Until `turnstile admin provision` has run, it logs the missing stream or bucket as an error
/// and tries again, so services may start before the provisioning; `shutdown` ends the wait.
pub async fn start(
    url: &str,
    name: &str,
    shutdown: &CancellationToken,
) -> Result<Connected, StartError> {
    let (bare, _) = split_credentials(url);
    let client = connect(url, name)
        .await
        .map_err(|source| StartError::Connect { url: bare, source })?;
    let js = async_nats::jetstream::new(client.clone());
    let mut delays = BIND_RETRY.delays();
    let buckets = loop {
        match crate::topology::bind(&js).await {
            Ok(b) => break b,
            Err(e) => {
                tracing::error!(service = name, error = %e, "topology not ready; retrying");
                if !delays.wait_or_cancel(shutdown).await {
                    return Err(StartError::Cancelled);
                }
            }
        }
    };
    Ok(Connected {
        client,
        js,
        buckets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_leave_the_url() {
        assert_eq!(
            split_credentials("nats://lane:s3cret@nats:4222"),
            (
                "nats://nats:4222".to_string(),
                Some(("lane".to_string(), "s3cret".to_string()))
            )
        );
        assert_eq!(
            split_credentials("nats://127.0.0.1:4222"),
            ("nats://127.0.0.1:4222".to_string(), None)
        );
        assert_eq!(
            split_credentials("localhost"),
            ("localhost".to_string(), None)
        );
        // A cluster's seed list: the credentials once, every server after them.
        let (bare, creds) = split_credentials("nats://lane:s3cret@nats:4222,nats-2:4222");
        assert_eq!(creds, Some(("lane".to_string(), "s3cret".to_string())));
        assert_eq!(
            seed_servers(&bare),
            vec![
                "nats://nats:4222".to_string(),
                "nats://nats-2:4222".to_string()
            ]
        );
        assert_eq!(
            seed_servers("tls://a:4222, tls://b:4222"),
            vec!["tls://a:4222".to_string(), "tls://b:4222".to_string()]
        );
    }
}
