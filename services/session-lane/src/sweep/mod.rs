//! The sweep: one replica (the first live one, `liveness::rank`) looks at every lane every
//! `--sweep-every` (30 s) for the two states that no event would ever end, both found by the fault
//! campaign on a cluster under overlapping faults, and repairs what it finds there twice running:
//! - [`stranded`]: an idle lane consumer past items of its lane still stored (a consumer
//!   leader that lost deliveries across a leader change): the items go to the lane's end;
//! - [`unarmed`]: an idle lane whose session has completions not handed over and no delivery
//!   on its way (the handler that held them cut off, its re-arm lost): a delivery is armed.
//!
//! One look serves both: one stream info (the lane subjects holding items), one list of the
//! lane consumers and one of the completion consumers. Twice running, 30 s apart, so that
//! nothing in passing (an item acked and about to be removed, a delivery being armed) is
//! acted on; both repairs are safe to repeat and to race with other replicas (two may each take
//! themselves for first for a moment).

mod look;
mod stranded;
mod unarmed;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::ctx::Ctx;

/// Sweeps until `cancel`.
pub(crate) async fn run(ctx: Arc<Ctx>, every: Duration, cancel: CancellationToken) {
    let mut stranded_seen = HashMap::new();
    let mut unarmed_seen = unarmed::Memory::default();
    let mut sweeping = None;
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let first = ctx.rank.first();
        if sweeping != Some(first) {
            sweeping = Some(first);
            match first {
                true => tracing::info!("this replica sweeps the lanes (the first live one)"),
                false => tracing::info!("another replica sweeps the lanes (the first live one)"),
            }
        }
        if !ctx.lease.held() || !first {
            // What was seen before is no evidence for the next look (it would act on one).
            stranded_seen.clear();
            unarmed_seen = unarmed::Memory::default();
            continue;
        }
        match look::look(&ctx.js).await {
            Ok(looked) => {
                stranded_seen =
                    stranded::sweep(&ctx.js, &looked.stored, &looked.lanes, &stranded_seen).await;
                unarmed_seen = unarmed::sweep(&ctx, &looked, &unarmed_seen).await;
            }
            Err(e) => tracing::warn!(error = %e, "sweep the lanes: look at them"),
        }
    }
}
