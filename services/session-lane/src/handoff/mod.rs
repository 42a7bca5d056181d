//! The hand-off primitives the lane's item kinds share, called downward only (the kinds in
//! `lane/` use them; nothing here knows the kinds):
//!
//! - `item`: free the lane of an item done with (acked, then removed from the lane stream),
//!   give it back, or refuse it to the dead-letter subject (R15);
//! - `turn`: dispatch a turn, wait for its recorded outcome, tell its end and finish it (R9,
//!   R14); `lost_command`: a command lost after it was stored is sent again while it waits;
//! - `completions`: collect, check (R8) and settle (R3) the completions a turn carries, and
//!   the delivery marker's clearing and re-arming; `admit`: the R8 check of each; `collected`: what was collected lately;
//!   `standby`: the pull a busy lane keeps out for its next completions; `rearm`: arming
//!   a delivery from the lane;
//! - `reconnect`: a reply lost with a reconnect is not waited out.

mod admit;
mod collected;
mod completions;
mod item;
mod lost_command;
mod rearm;
mod reconnect;
mod standby;
mod turn;

pub(crate) use collected::{Collected, HandedOver};
pub(crate) use completions::{
    collect, collect_expecting, disarm_and_recheck, keep_standby, settle, DeliveryError, Expected,
};
pub(crate) use item::{acked, reject, release, remove_item, retry_later};
pub(crate) use rearm::{arm_for_waiting, pending_completions, rearm_if_pending};
pub(crate) use standby::Standbys;
pub(crate) use turn::{dispatch, finish, outcome_event, tell_end, wait_terminal, Watch};
