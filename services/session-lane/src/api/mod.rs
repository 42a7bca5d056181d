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
    use turnstile_shared::service_info::add;
    macro_rules! endpoint {
        ($group:ident, $verb:literal, $handler:path) => {{
            tasks.push(
                add(&$group, $verb, ctx.clone(), shutdown.clone(), $handler)
                    .await
                    .map_err(Error::Api)?,
            );
        }};
    }
    endpoint!(group, "create", sessions::create);
    endpoint!(group, "send", sessions::send);
    endpoint!(group, "stop", sessions::stop);
    endpoint!(group, "list", sessions::list);
    endpoint!(group, "show", sessions::show);
    endpoint!(group, "hosts", sessions::hosts);
    let runs = service.group(subjects::api::RUNS_GROUP);
    endpoint!(runs, "start", runs::start_run);
    endpoint!(runs, "show", runs::show_run);
    endpoint!(runs, "list", runs::list_runs);
    endpoint!(runs, "cancel", runs::cancel_run);
    endpoint!(runs, "retry", runs::retry_run);
    futures::future::join_all(tasks).await;
    let _ = service.stop().await;
    Ok(())
}
