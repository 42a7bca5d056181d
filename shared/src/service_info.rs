//! What `$SRV.INFO` says of each endpoint: its wire types and where it is documented, taken
//! from the handler's own types so the description cannot drift from the code. Endpoints are
//! added through [`add`] and [`add_principal`], which attach this metadata and start serving.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use async_nats::service::Group;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::api::ApiError;
use crate::principal::Principal;

/// Where the request/reply APIs are described.
pub const API_DOCS: &str = "docs/topology.md#requestreply-api";

/// `Page<SessionView>` for `turnstile_shared::page::Page<turnstile_shared::api::SessionView>`:
/// a type's name without its module paths.
pub fn short_type_name<T: ?Sized>() -> String {
    let full = std::any::type_name::<T>();
    let mut out = String::new();
    let mut word = String::new();
    for c in full.chars() {
        if c.is_alphanumeric() || c == '_' || c == ':' {
            word.push(c);
        } else {
            out.push_str(word.rsplit("::").next().unwrap_or(&word));
            word.clear();
            out.push(c);
        }
    }
    out.push_str(word.rsplit("::").next().unwrap_or(&word));
    out
}

/// The metadata of an endpoint taking `Req` and replying `Resp`.
pub fn metadata<Req, Resp>(principal: bool) -> HashMap<String, String> {
    let mut m = HashMap::from([
        ("request".to_string(), short_type_name::<Req>()),
        ("reply".to_string(), short_type_name::<Resp>()),
        (
            "format".to_string(),
            "JSON request; reply {\"ok\": reply} or {\"error\": {\"code\", \"message\"}}"
                .to_string(),
        ),
        ("docs".to_string(), API_DOCS.to_string()),
    ]);
    if principal {
        m.insert(
            "principal".to_string(),
            "the subject's <principal> token: session:<id> or step:<id>".to_string(),
        );
    }
    m
}

/// Adds `verb` to `group` (subject `<group>.<verb>`) with its metadata and serves it with
/// `handler` until `shutdown`.
pub async fn add<C, Req, Resp, F, Fut>(
    group: &Group,
    verb: &str,
    ctx: Arc<C>,
    shutdown: CancellationToken,
    handler: F,
) -> Result<JoinHandle<()>, async_nats::Error>
where
    C: Send + Sync + 'static,
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    F: Fn(Arc<C>, Req) -> Fut + Copy + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, ApiError>> + Send + 'static,
{
    let endpoint = endpoint::<Req, Resp>(group, verb, verb.to_string(), false).await?;
    Ok(tokio::spawn(crate::service::serve_endpoint(
        ctx, endpoint, shutdown, handler,
    )))
}

/// Like [`add`], for an endpoint on `subject` whose subjects carry the caller's principal.
pub async fn add_principal<C, Req, Resp, F, Fut>(
    group: &Group,
    verb: &str,
    subject: String,
    ctx: Arc<C>,
    shutdown: CancellationToken,
    handler: F,
) -> Result<JoinHandle<()>, async_nats::Error>
where
    C: Send + Sync + 'static,
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    F: Fn(Arc<C>, Principal, Req) -> Fut + Copy + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, ApiError>> + Send + 'static,
{
    let endpoint = endpoint::<Req, Resp>(group, verb, subject, true).await?;
    Ok(tokio::spawn(crate::service::serve_principal_endpoint(
        ctx, endpoint, shutdown, handler,
    )))
}

/// The endpoint `verb` on `subject` (relative to the group), with its metadata.
async fn endpoint<Req, Resp>(
    group: &Group,
    verb: &str,
    subject: String,
    principal: bool,
) -> Result<async_nats::service::endpoint::Endpoint, async_nats::Error> {
    group
        .endpoint_builder()
        .name(verb)
        .metadata(metadata::<Req, Resp>(principal))
        .add(subject)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_names_lose_their_paths_and_keep_their_shape() {
        assert_eq!(
            short_type_name::<crate::page::Page<crate::api::SessionView>>(),
            "Page<SessionView>"
        );
        assert_eq!(short_type_name::<Vec<String>>(), "Vec<String>");
        assert_eq!(short_type_name::<()>(), "()");
    }
}
