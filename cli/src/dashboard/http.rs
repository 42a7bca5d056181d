//! The dashboard's HTTP side: `/` the page (one HTML file with its script inline, no build
//! step), `/events` the live feed as server-sent events (`snapshot` first, then one `ts` event
//! per lifecycle event, `resync` when the page must start over), `/snapshot` the snapshot as
//! JSON (for scripts), `/healthz`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame};
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use super::feed::Feed;
use super::snapshot::{self, Limits};

/// The page: markup, style and script in one file, served as it is.
const PAGE: &str = include_str!("page.html");
/// A comment line keeps idle connections open through proxies.
const KEEPALIVE: Duration = Duration::from_secs(15);
/// Frames one page may have unsent before it counts as gone.
const PAGE_BUFFER: usize = 256;

type Body = BoxBody<Bytes, Infallible>;

/// What every request handler shares.
pub struct State {
    pub client: async_nats::Client,
    /// The server without credentials, as shown on the page.
    pub server: String,
    pub feed: broadcast::Sender<Feed>,
    /// `Host` headers served: the listening address, localhost, `--allow-host`.
    pub hosts: Vec<String>,
    pub limits: Limits,
    pub shutdown: CancellationToken,
}

/// Serves until `shutdown`.
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<State>) {
    let shutdown = state.shutdown.clone();
    turnstile_shared::health::serve_http(listener, shutdown, "dashboard", move |req| {
        let state = state.clone();
        async move { route(&state, &req).await }
    })
    .await;
}

async fn route<B>(state: &Arc<State>, req: &Request<B>) -> Response<Body> {
    let host = req
        .headers()
        .get(hyper::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or_default();
    if !host_allowed(&state.hosts, host) {
        return full(
            StatusCode::FORBIDDEN,
            "text/plain",
            format!("host {host:?} is not served here: add --allow-host to serve it\n"),
        );
    }
    match req.uri().path() {
        "/" | "/index.html" => full(StatusCode::OK, "text/html; charset=utf-8", PAGE.into()),
        "/events" => events(state),
        "/snapshot" => {
            let json = snapshot_json(state).await;
            full(StatusCode::OK, "application/json", json)
        }
        "/healthz" => full(StatusCode::OK, "text/plain", "up\n".into()),
        other => full(
            StatusCode::NOT_FOUND,
            "text/plain",
            format!("no page {other}: try / or /events\n"),
        ),
    }
}

/// The `Host` header names an address this dashboard answers to (exactly, or by name
/// without its port for an `--allow-host NAME`).
fn host_allowed(hosts: &[String], host: &str) -> bool {
    let name = host.rsplit_once(':').map_or(host, |(n, _)| n);
    hosts
        .iter()
        .any(|h| h == host || (!h.contains(':') && h == name))
}

fn full(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(body)).boxed());
    *response.status_mut() = status;
    headers(&mut response, content_type);
    response
}

/// Every response: its type, never cached, never sniffed as another type, and the page may
/// load nothing from elsewhere.
fn headers(response: &mut Response<Body>, content_type: &'static str) {
    let h = response.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        "content-security-policy",
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
             connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'",
        ),
    );
}

async fn snapshot_json(state: &State) -> String {
    let snap = snapshot::take(&state.client, &state.server, state.limits).await;
    match serde_json::to_value(&snap) {
        Ok(mut value) => {
            snapshot::redact(&mut value);
            value.to_string()
        }
        Err(e) => {
            serde_json::json!({ "errors": [format!("encode the snapshot: {e}")] }).to_string()
        }
    }
}

/// `/events`: a page's own stream. It subscribes to the feed before it reads the snapshot, so
/// an event of the moment of reading is in one or the other (or both: the page ignores a
/// state that would go backwards).
fn events(state: &Arc<State>) -> Response<Body> {
    let (tx, rx) = mpsc::channel::<Bytes>(PAGE_BUFFER);
    let feed = state.feed.subscribe();
    tokio::spawn(stream_page(state.clone(), feed, tx));
    let frames = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    let mut response = Response::new(BodyExt::boxed(StreamBody::new(frames)));
    headers(&mut response, "text/event-stream");
    response
}

async fn stream_page(
    state: Arc<State>,
    mut feed: broadcast::Receiver<Feed>,
    tx: mpsc::Sender<Bytes>,
) {
    // What arrives while the snapshot is read is kept (not left to lag the receiver) and
    // sent after it.
    let snapshot = snapshot_json(&state);
    tokio::pin!(snapshot);
    let mut early = Vec::new();
    let snap = loop {
        tokio::select! {
            biased;
            _ = state.shutdown.cancelled() => return,
            s = &mut snapshot => break s,
            f = feed.recv() => match f {
                Ok(Feed::Resync) | Err(broadcast::error::RecvError::Lagged(_)) => {
                    let _ = tx.send(frame("resync", "{}", Some(1000))).await;
                    return;
                }
                Ok(f) if early.len() < super::feed::BACKLOG => early.push(f),
                Ok(_) => {
                    let _ = tx.send(frame("resync", "{}", Some(1000))).await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
        }
    };
    // A page that loses its stream reconnects after a second and starts over.
    if tx.send(frame("snapshot", &snap, Some(1000))).await.is_err() {
        return;
    }
    for f in early {
        let Some(out) = feed_frame(&f) else { return };
        if tx.send(out).await.is_err() {
            return;
        }
    }
    let mut keepalive = tokio::time::interval(KEEPALIVE);
    keepalive.tick().await;
    loop {
        let out = tokio::select! {
            biased;
            _ = state.shutdown.cancelled() => return,
            _ = tx.closed() => return,
            f = feed.recv() => match f {
                Ok(f) => match feed_frame(&f) {
                    Some(out) => out,
                    None => {
                        let _ = tx.send(frame("resync", "{}", None)).await;
                        return;
                    }
                },
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let _ = tx.send(frame("resync", "{}", None)).await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = keepalive.tick() => Bytes::from_static(b": keepalive\n\n"),
        };
        if tx.send(out).await.is_err() {
            return;
        }
    }
}

/// The frame of one feed item; `None` for `Resync` (the stream ends).
fn feed_frame(f: &Feed) -> Option<Bytes> {
    match f {
        Feed::Event(e) => Some(frame("ts", e, None)),
        Feed::Session(s) => Some(frame("session", s, None)),
        Feed::Schedule(s) => Some(frame("schedule", s, None)),
        Feed::Resync => None,
    }
}

/// One server-sent event; a line break inside `data` starts another `data:` line.
fn frame(event: &str, data: &str, retry_ms: Option<u64>) -> Bytes {
    let mut out = String::with_capacity(data.len() + 32);
    if let Some(ms) = retry_ms {
        out.push_str(&format!("retry: {ms}\n"));
    }
    out.push_str("event: ");
    out.push_str(event);
    out.push('\n');
    for line in data.split('\n') {
        out.push_str("data: ");
        out.push_str(line);
        out.push('\n');
    }
    out.push('\n');
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page's event handlers are keyed by event kinds of the registry (a misspelt key
    /// would never fire).
    #[test]
    fn the_page_handles_only_real_event_kinds() {
        let start = PAGE.find("const handlers = {").expect("handlers");
        let body = &PAGE[start..PAGE[start..].find("\n};").expect("end") + start];
        let mut keys = 0;
        for part in body.split('"').skip(1).step_by(2) {
            if part.contains('.') && !part.contains(' ') {
                assert!(
                    part.parse::<turnstile_shared::events::EventKind>().is_ok(),
                    "the page handles {part:?}, which is no event kind"
                );
                keys += 1;
            }
        }
        assert!(keys >= 20, "found {keys} handler keys");
    }

    #[test]
    fn only_the_served_hosts_are_answered() {
        let hosts = vec!["127.0.0.1:8090".to_string(), "dash.example".to_string()];
        assert!(host_allowed(&hosts, "127.0.0.1:8090"));
        assert!(host_allowed(&hosts, "dash.example:443"));
        assert!(host_allowed(&hosts, "dash.example"));
        assert!(!host_allowed(&hosts, "127.0.0.1:9999"));
        assert!(!host_allowed(&hosts, "evil.example:8090"));
        assert!(!host_allowed(&hosts, ""));
    }

    #[test]
    fn frames_follow_the_event_stream_format() {
        let f = frame("ts", "{\"a\":1}", None);
        assert_eq!(&f[..], b"event: ts\ndata: {\"a\":1}\n\n");
        let f = frame("snapshot", "a\nb", Some(1000));
        assert_eq!(
            &f[..],
            b"retry: 1000\nevent: snapshot\ndata: a\ndata: b\n\n"
        );
    }
}
