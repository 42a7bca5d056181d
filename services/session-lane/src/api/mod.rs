//! The session-lane's request/reply service (discoverable with `nats micro ls`), one file per
//! API: `sessions` (`ts.api.session.*`) and `runs` (`ts.api.runs.*`). This module only builds
//! the service and binds each endpoint to its handler; a bad request gets a clear error while
//! the service keeps serving (R15).

mod runs;
mod sessions;

use std::sync::Arc;

use async_nats::service::ServiceExt;
use tokio_util::sync::CancellationToken;
use turnstile_shared::subjects;

use crate::ctx::{Ctx, Error};

pub(crate) async fn serve(ctx: Arc<Ctx>, shutdown: CancellationToken) -> Result<(), Error> {
    let service = ctx
        .client
        .service_builder()
        .description("Turnstile sessions: create, send, stop, list, show")
        .start(subjects::api::SESSION_SERVICE, env!("CARGO_PKG_VERSION"))
        .await
        .map_err(Error::Api)?;
    let group = service.group(subjects::api::SESSION_GROUP);
    let mut tasks = Vec::new();
    macro_rules! endpoint {
        ($verb:literal, $handler:path) => {{
            let endpoint = group.endpoint($verb).await.map_err(Error::Api)?;
            tasks.push(tokio::spawn(turnstile_shared::service::serve_endpoint(
                ctx.clone(),
                endpoint,
                shutdown.clone(),
                $handler,
            )));
        }};
    }
    endpoint!("create", sessions::create);
    endpoint!("send", sessions::send);
    endpoint!("stop", sessions::stop);
    endpoint!("list", sessions::list);
    endpoint!("show", sessions::show);
    endpoint!("hosts", sessions::hosts);
    let runs = service.group(subjects::api::RUNS_GROUP);
    for (verb, which) in [
        ("start", 0),
        ("show", 1),
        ("list", 2),
        ("cancel", 3),
        ("retry", 4),
    ] {
        let endpoint = runs.endpoint(verb).await.map_err(Error::Api)?;
        let (ctx, shutdown) = (ctx.clone(), shutdown.clone());
        use turnstile_shared::service::serve_endpoint as serve;
        tasks.push(match which {
            0 => tokio::spawn(serve(ctx, endpoint, shutdown, runs::start_run)),
            1 => tokio::spawn(serve(ctx, endpoint, shutdown, runs::show_run)),
            3 => tokio::spawn(serve(ctx, endpoint, shutdown, runs::cancel_run)),
            4 => tokio::spawn(serve(ctx, endpoint, shutdown, runs::retry_run)),
            _ => tokio::spawn(serve(ctx, endpoint, shutdown, runs::list_runs)),
        });
    }
    futures::future::join_all(tasks).await;
    let _ = service.stop().await;
    Ok(())
}
