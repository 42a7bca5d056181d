//! The broker's NATS micro service: one service (`subjects::api::BROKER_SERVICE`, a queue
//! group across replicas) with the `ts.api.steps.*` group (handlers in [`steps`]) and the
//! `ts.api.exec.*` group (handlers in [`exec`]), each subject carrying the principal a call
//! acts for (`ts.api.steps.<principal>.<verb>`). This file only wires endpoints to handlers;
//! calls go down from here to the handler modules, never back.

mod answers;
mod exec;
mod steps;

use std::sync::Arc;

use async_nats::service::ServiceExt;
use tokio_util::sync::CancellationToken;
use turnstile_shared::subjects;

use crate::ctx::{Ctx, Error};

/// Serves both groups until `shutdown` is cancelled.
pub(crate) async fn serve(ctx: Arc<Ctx>, shutdown: CancellationToken) -> Result<(), Error> {
    let service = ctx
        .client
        .service_builder()
        .description("Turnstile steps and the execution tree")
        .start(subjects::api::BROKER_SERVICE, env!("CARGO_PKG_VERSION"))
        .await
        .map_err(Error::Api)?;
    let steps_group = service.group(subjects::api::STEPS_GROUP);
    let exec_group = service.group(subjects::api::EXEC_GROUP);
    let mut tasks = Vec::new();
    // Each endpoint takes any principal (`ts.api.steps.<principal>.start`); the handler gets
    // the one its request came on and checks the request's credentials against it.
    macro_rules! endpoint {
        ($group:ident, $verb:expr, $handler:path) => {{
            tasks.push(
                turnstile_shared::service_info::add_principal(
                    &$group,
                    $verb,
                    subjects::api::any_principal($verb),
                    ctx.clone(),
                    shutdown.clone(),
                    $handler,
                )
                .await
                .map_err(Error::Api)?,
            );
        }};
    }
    use subjects::api::{CANCEL, CANCEL_SESSION, LIST, REPORT, START, STATUS, TREE};
    endpoint!(steps_group, START, steps::start);
    endpoint!(steps_group, REPORT, steps::report);
    endpoint!(steps_group, STATUS, steps::status);
    endpoint!(steps_group, LIST, steps::list);
    endpoint!(exec_group, TREE, exec::tree);
    endpoint!(exec_group, CANCEL, exec::cancel);
    endpoint!(exec_group, CANCEL_SESSION, exec::cancel_session);
    futures::future::join_all(tasks).await;
    let _ = service.stop().await;
    Ok(())
}
