//! Waiting for a run turn's whole subtree (R5): the tree is read from the broker's exec API,
//! step events and heartbeats are progress (R10), a cancel notice interrupts, and the wait
//! for the completions of what finished is bounded.

use std::collections::HashSet;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use turnstile_shared::api;
use turnstile_shared::delivery::Completion;
use turnstile_shared::principal::Principal;
use turnstile_shared::step_api::{ExecRef, TreeNode};
use turnstile_shared::subjects;
use turnstile_shared::{ExecutionId, SessionId, TurnId};

use super::driver::{DriveError, Driver, Wait, API};
use turnstile_shared::retry::Backoff;

use crate::handoff::collect;

/// How often a wait for children re-reads the tree even without an event: soon at first (a
/// turn without children settles as soon as the broker has recorded its end, usually within
/// milliseconds), then at most every two seconds (a missed event costs at most that).
const RECHECK: Backoff = Backoff::new(Duration::from_millis(10), Duration::from_secs(2));

/// How often a run looks again for the completions of what its turn's subtree finished.
const COMPLETIONS_POLL: Backoff =
    Backoff::new(Duration::from_millis(20), Duration::from_millis(500));

/// How long a run waits for the completions routed to its session once the turn's subtree
/// has ended: longer than a store briefly out of reach (a node cut off for 20 s, a leader
/// election). A run waits it whole only for a completion that does not come (see
/// [`collect_ids`]).
const COMPLETIONS_WAIT: Duration = Duration::from_secs(30);

impl Driver<'_> {
    /// Waits until the turn's whole subtree is terminal (R5). Step events are progress (R10).
    pub(super) async fn wait_children(
        &self,
        index: usize,
        turn: &TurnId,
    ) -> Result<Wait, DriveError> {
        let mut events = match self
            .ctx
            .client
            .subscribe(subjects::session_step_events(&self.session.id))
            .await
        {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "step events; re-reading the tree on a timer");
                None
            }
        };
        let mut cancel_notice = self
            .ctx
            .client
            .subscribe(subjects::run_cancel(&self.run.id))
            .await
            .ok();
        // Step heartbeats are progress too (R10).
        let mut beats = self
            .ctx
            .client
            .subscribe(subjects::progress(&self.session.id))
            .await
            .ok();
        let mut last_progress = tokio::time::Instant::now();
        let id = ExecutionId::from(turn);
        let mut recheck = RECHECK.delays();
        loop {
            let tree: Option<TreeNode> = api::call(
                &self.ctx.client,
                &Principal::Operator.exec(subjects::api::TREE),
                &ExecRef { id: id.clone() },
                API,
            )
            .await
            .ok();
            if let Some(t) = &tree {
                if t.settled {
                    let mut ids = Vec::new();
                    collect_ids(t, &self.session.id, &mut ids);
                    return Ok(Wait::Settled(ids));
                }
            }
            let idle = self.run.limits.idle_timeout;
            let deadline = last_progress + idle;
            if let Some(end) = self.over_time(index) {
                return Ok(Wait::OverTime(end));
            }
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return Ok(Wait::Cancelled),
                Some(_) = async { match cancel_notice.as_mut() { Some(s) => s.next().await, None => std::future::pending().await } } => {
                    return Ok(Wait::RunCancelled);
                }
                Some(_) = async { match events.as_mut() { Some(s) => s.next().await, None => std::future::pending().await } } => {
                    last_progress = tokio::time::Instant::now();
                }
                Some(_) = async { match beats.as_mut() { Some(s) => s.next().await, None => std::future::pending().await } } => {
                    last_progress = tokio::time::Instant::now();
                }
                _ = recheck.wait() => {}
                _ = tokio::time::sleep_until(deadline) => return Ok(Wait::Idle),
            }
            // Keep the run item alive while it waits (under the lease only).
            if self.ctx.lease.held() {
                let _ = self.msg.ack_with(AckKind::Progress).await;
            }
        }
    }
    /// Takes pending completions for the session, waiting (bounded by [`COMPLETIONS_WAIT`])
    /// until every execution of the turn's subtree routed to this session has its completion
    /// here: routing follows the terminal record, and the store can be out of reach for a
    /// while (a 20 s partition outlasted the 10 s this wait once had, and the run ended
    /// without a step's result, R5). The run's item is kept alive meanwhile.
    pub(super) async fn take_completions(
        &self,
        expected: &[ExecutionId],
    ) -> Result<(Vec<(Completion, u64)>, Vec<jetstream::Message>), DriveError> {
        let mut want: HashSet<ExecutionId> = expected.iter().cloned().collect();
        let mut carried = Vec::new();
        let mut held = Vec::new();
        let deadline = tokio::time::Instant::now() + COMPLETIONS_WAIT;
        let mut pauses = COMPLETIONS_POLL.delays();
        // Progress acks a third of an ack wait apart, not at every look (every 20-500 ms).
        let every = (self.ctx.topology.lane_ack_wait / 3).max(Duration::from_millis(100));
        let mut progressed = tokio::time::Instant::now();
        loop {
            let (c, h) = collect(self.ctx, self.session).await?;
            merge(&mut carried, &mut held, c, h, stream_seq);
            for (comp, _) in &carried {
                want.remove(&comp.execution);
            }
            // Only executions routed here and not handed over yet are expected; one whose
            // completion never comes all the same ends the wait at its bound.
            if want.is_empty()
                || tokio::time::Instant::now() >= deadline
                || self.cancel.is_cancelled()
            {
                return Ok((carried, held));
            }
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => {}
                _ = pauses.wait() => {}
            }
            // What this wait holds already stays this run's while it waits for the rest (the
            // wait may outlast the completions' ack wait; a copy handed out again meanwhile,
            // when a progress ack was lost, is taken once: `merge`); so does the run's item.
            if self.ctx.lease.held() && progressed.elapsed() >= every {
                for h in &held {
                    let _ = h.ack_with(AckKind::Progress).await;
                }
                let _ = self.msg.ack_with(AckKind::Progress).await;
                progressed = tokio::time::Instant::now();
            }
        }
    }
}

/// Adds one round's take to what the wait took before. A completion already taken is not
/// carried again: a message handed out again (its ack wait ran out while the run waited and
/// a progress ack was lost, as across a NATS restart), or another stored message of the same
/// end (R14). A message delivered again replaces its earlier delivery among those to ack (the
/// earlier delivery's ack would be void).
fn merge<M>(
    carried: &mut Vec<(Completion, u64)>,
    held: &mut Vec<M>,
    round: Vec<(Completion, u64)>,
    round_held: Vec<M>,
    seq: impl Fn(&M) -> Option<u64>,
) {
    for (comp, s) in round {
        if !carried.iter().any(|(c, _)| c.execution == comp.execution) {
            carried.push((comp, s));
        }
    }
    for m in round_held {
        let s = seq(&m);
        held.retain(|h| s.is_none() || seq(h) != s);
        held.push(m);
    }
}

fn stream_seq(m: &jetstream::Message) -> Option<u64> {
    m.info().map(|i| i.stream_sequence).ok()
}

/// The executions of a subtree whose completions come to `session` (its owner or a watcher)
/// and are still to come: one handed to the session already is not (a retried run continues
/// with the tree of its failed attempt, whose results a delivery turn may have carried since;
/// waiting for one of them held the run for the whole [`COMPLETIONS_WAIT`]).
fn collect_ids(node: &TreeNode, session: &SessionId, out: &mut Vec<ExecutionId>) {
    for n in &node.nodes {
        if n.record.may_receive(session) && n.record.handed_to(session).is_none() {
            out.push(n.record.id.clone());
        }
        collect_ids(n, session, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(execution: &ExecutionId) -> Completion {
        Completion {
            execution: execution.clone(),
            name: "step".into(),
            status: "completed".into(),
            summary: "exit 0".into(),
            ended_at: chrono::Utc::now(),
        }
    }

    /// R14: a completion handed out again while the run waited for the rest (its ack wait ran
    /// out, a progress ack lost across a NATS restart) is carried once, and only its latest
    /// delivery is kept to ack. The campaign (seed 1, 10 min) found a run turn carrying two
    /// completions twice each.
    #[test]
    fn a_completion_taken_again_in_a_later_round_is_carried_once() {
        let (a, b) = (
            ExecutionId::from(turnstile_shared::StepId::new()),
            ExecutionId::from(turnstile_shared::StepId::new()),
        );
        let (mut carried, mut held) = (Vec::new(), Vec::new());
        let seq = |m: &(u64, u32)| Some(m.0);
        // Round one takes a (stream seq 18, first delivery); round two takes a again (its
        // second delivery) and b (seq 19).
        merge(
            &mut carried,
            &mut held,
            vec![(completion(&a), 18)],
            vec![(18, 1)],
            seq,
        );
        merge(
            &mut carried,
            &mut held,
            vec![(completion(&a), 18), (completion(&b), 19)],
            vec![(18, 2), (19, 1)],
            seq,
        );
        let ids: Vec<_> = carried.iter().map(|(c, _)| c.execution.clone()).collect();
        assert_eq!(ids, vec![a.clone(), b]);
        assert_eq!(
            held,
            vec![(18, 2), (19, 1)],
            "the later delivery of 18 is acked"
        );
        // Another stored message of a's end (seq 25): not carried, but held (acked with the
        // turn, so it is not handed over later either).
        merge(
            &mut carried,
            &mut held,
            vec![(completion(&a), 25)],
            vec![(25, 1)],
            seq,
        );
        assert_eq!(carried.len(), 2);
        assert_eq!(held.len(), 3);
    }
}
