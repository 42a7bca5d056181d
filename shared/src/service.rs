//! The one request loop behind every `ts.api.*` endpoint: decode, call the handler, reply
//! `{"ok": ...}` or `{"error": ...}`. A bad request gets a clear error and the endpoint keeps
//! serving everyone else (R15).

use std::future::Future;
use std::sync::Arc;

use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::api::{ApiError, Reply};
use crate::principal::Principal;

/// Serves one endpoint until `shutdown`; each request runs on its own task.
pub async fn serve_endpoint<C, Req, Resp, F, Fut>(
    ctx: Arc<C>,
    endpoint: async_nats::service::endpoint::Endpoint,
    shutdown: CancellationToken,
    handler: F,
) where
    C: Send + Sync + 'static,
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    F: Fn(Arc<C>, Req) -> Fut + Copy + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, ApiError>> + Send + 'static,
{
    serve(ctx, endpoint, shutdown, move |ctx, _subject: &str, req| {
        Ok(handler(ctx, req))
    })
    .await
}

/// Like [`serve_endpoint`], for an endpoint whose subject carries a principal
/// (`ts.api.<area>.<principal>.<verb>`): the handler gets it, read off the subject the
/// request came on; a subject without one is refused.
pub async fn serve_principal_endpoint<C, Req, Resp, F, Fut>(
    ctx: Arc<C>,
    endpoint: async_nats::service::endpoint::Endpoint,
    shutdown: CancellationToken,
    handler: F,
) where
    C: Send + Sync + 'static,
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    F: Fn(Arc<C>, Principal, Req) -> Fut + Copy + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, ApiError>> + Send + 'static,
{
    serve(ctx, endpoint, shutdown, move |ctx, subject: &str, req| {
        Principal::from_subject(subject).map(|p| handler(ctx, p, req))
    })
    .await
}

async fn serve<C, Req, Resp, F, Fut>(
    ctx: Arc<C>,
    mut endpoint: async_nats::service::endpoint::Endpoint,
    shutdown: CancellationToken,
    handler: F,
) where
    C: Send + Sync + 'static,
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    F: Fn(Arc<C>, &str, Req) -> Result<Fut, ApiError> + Copy + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, ApiError>> + Send + 'static,
{
    loop {
        let request = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            r = endpoint.next() => match r { Some(r) => r, None => return },
        };
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let subject = request.message.subject.as_str();
            let reply = match serde_json::from_slice::<Req>(&request.message.payload) {
                Ok(req) => match handler(ctx, subject, req) {
                    Ok(fut) => fut.await,
                    Err(e) => Err(e),
                },
                Err(e) => Err(ApiError::bad_request(format!(
                    "invalid request on {subject}: {e}"
                ))),
            };
            let body = match reply {
                Ok(v) => serde_json::to_vec(&Reply::Ok(v)),
                Err(e) => {
                    tracing::info!(%subject, error = %e, "request refused");
                    serde_json::to_vec(&Reply::<()>::Error(e))
                }
            };
            let body = body.unwrap_or_else(|e| {
                format!(
                    "{{\"error\":{{\"code\":\"{}\",\"message\":\"encode reply: {e}\"}}}}",
                    crate::api::ErrorCode::Internal
                )
                .into_bytes()
            });
            if let Err(e) = request.respond(Ok(body.into())).await {
                tracing::debug!(error = %e, "reply");
            }
        });
    }
}
