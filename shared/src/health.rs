//! `--http ADDR`: every service's health endpoints, for orchestrators and operators.
//!
//! - `/healthz`: 200 while the process is up and its NATS connection is open.
//! - `/readyz`: 200 once the service has bound the topology and started serving, while its NATS
//!   connection is open and the server has refused it no permission. A refusal means its
//!   identity lacks a subject it needs (a deployment error): the service stays not ready, with
//!   the server's words, until it is restarted on a fixed configuration.
//! - `/metrics`: the process's Prometheus metrics ([`crate::metrics`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use tokio_util::sync::CancellationToken;

/// The `--http` flag every service takes.
#[derive(Debug, Clone, clap::Args)]
pub struct HealthArgs {
    /// Serve `/healthz`, `/readyz` and `/metrics` on this address (e.g. `0.0.0.0:8080`).
    #[arg(long = "http", env = "TURNSTILE_HTTP")]
    pub addr: Option<SocketAddr>,
}

/// What the endpoints report: set by the service as it starts.
#[derive(Default)]
pub struct Health {
    /// The service's connection, once the topology is bound and it serves.
    serving: OnceLock<async_nats::Client>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("serving", &self.serving.get().is_some())
            .finish()
    }
}

impl Health {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// The service has bound the topology and started its work on `client`.
    pub fn serving(&self, client: &async_nats::Client) {
        let _ = self.serving.set(client.clone());
    }

    fn connected(&self) -> bool {
        self.serving
            .get()
            .is_some_and(|c| c.connection_state() == async_nats::connection::State::Connected)
    }

    /// `/healthz`.
    pub fn healthz(&self) -> (StatusCode, String) {
        match self.serving.get() {
            None => (StatusCode::OK, "up; starting\n".into()),
            Some(_) if self.connected() => (StatusCode::OK, "up; NATS connected\n".into()),
            Some(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "NATS connection lost; reconnecting\n".into(),
            ),
        }
    }

    /// `/readyz`.
    pub fn readyz(&self) -> (StatusCode, String) {
        let refusals = crate::config::permission_refusals();
        if refusals > 0 {
            let last = crate::config::last_permission_refusal().unwrap_or_default();
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "not ready: the NATS server refused this service {refusals} permission(s) \
                     (its identity lacks a subject it needs); latest: {last}\n"
                ),
            );
        }
        if self.serving.get().is_none() {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: connecting to NATS and binding the topology\n".into(),
            );
        }
        if !self.connected() {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: NATS connection lost; reconnecting\n".into(),
            );
        }
        (StatusCode::OK, "ready\n".into())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("serve health endpoints on {addr}: {source}")]
pub struct HealthError {
    addr: SocketAddr,
    source: std::io::Error,
}

/// Serves the endpoints on `addr` until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> Result<(), HealthError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| HealthError { addr, source })?;
    tracing::info!(%addr, "health endpoints: /healthz, /readyz, /metrics");
    serve_http(listener, shutdown, "health endpoint", move |req| {
        let health = health.clone();
        async move { respond(&health, &req) }
    })
    .await;
    Ok(())
}

/// Answers HTTP/1 requests on `listener` with `handle`, one task per connection, until
/// `shutdown` (the health endpoints, `turnstile dashboard`).
pub async fn serve_http<F, Fut, B>(
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
    what: &'static str,
    handle: F,
) where
    F: Fn(Request<hyper::body::Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    loop {
        let (stream, _) = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "{what} accept");
                    continue;
                }
            },
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let response = handle(req);
                async move { Ok::<_, Infallible>(response.await) }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, service)
                .await
            {
                tracing::debug!(error = %e, "{what} connection");
            }
        });
    }
}

fn respond<B>(health: &Health, req: &Request<B>) -> Response<Full<Bytes>> {
    let (status, body) = match req.uri().path() {
        "/healthz" => health.healthz(),
        "/readyz" => health.readyz(),
        "/metrics" => {
            let mut response =
                Response::new(Full::new(Bytes::from(crate::metrics::metrics().encode())));
            if let Ok(v) = hyper::header::HeaderValue::from_str(crate::metrics::CONTENT_TYPE) {
                response
                    .headers_mut()
                    .insert(hyper::header::CONTENT_TYPE, v);
            }
            return response;
        }
        other => (
            StatusCode::NOT_FOUND,
            format!("no endpoint {other}: try /healthz, /readyz or /metrics\n"),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}

/// Starts the endpoints when `--http` was given; a failure to listen is logged as an error
/// (the service itself goes on).
pub fn spawn(args: &HealthArgs, health: &Arc<Health>, shutdown: &CancellationToken) {
    if let Some(addr) = args.addr {
        let (health, shutdown) = (health.clone(), shutdown.clone());
        tokio::spawn(async move {
            if let Err(e) = serve(addr, health, shutdown).await {
                tracing::error!(error = %e, "health endpoints");
            }
        });
    }
}
