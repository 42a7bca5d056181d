//! The lease a replica acts under: nothing is typed, acked, given back or written for a lane
//! unless this replica's last liveness renewal was *sent* less than [`Timing::lease`] ago.
//!
//! Why: a survivor takes a peer's lanes over only once it has not seen that peer renew for
//! longer than the lease (the silent path waits [`Timing::timeout`], the fast path
//! [`Timing::gone_after`] with the peer's connection gone from the server), and it sees a
//! renewal only after the peer sent it. So a replica whose lease is valid cannot have been
//! taken over yet. A replica SIGSTOPped past its timeout wakes with every lane worker
//! runnable; whichever runs first finds the lease lapsed (the monotonic clock ran on through
//! the pause) and waits, until the liveness loop's next renewal either succeeds (nobody took
//! it over: the lease is held again) or finds the key gone (fenced: nothing is done at all).
//!
//! The lease is also not held while this replica's connection is down. An act sent then
//! would wait in the client's buffer and go out only after the reconnect, which may come
//! after a survivor (that saw the connection gone from the server) took the lanes over. Only
//! an act sent in the moment between the connection's loss and the client noticing it can
//! still be late; the renewals fail meanwhile, so the lease lapses and acts wait for the next
//! renewal after the reconnect (which finds the key gone when the replica was taken over).
//!
//! [`Timing::lease`]: crate::ctx::Timing::lease
//! [`Timing::timeout`]: crate::ctx::Timing::timeout
//! [`Timing::gone_after`]: crate::ctx::Timing::gone_after

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// The replica was taken for dead by a survivor, which now serves its lanes (`liveness`).
#[derive(Debug, thiserror::Error)]
#[error("this replica's liveness key was taken by a survivor (it was silent for too long)")]
pub struct Fenced;

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Not announced yet, or a renewal failed: wait for the next one.
    Lapsed,
    /// The last renewal that succeeded was sent at `sent`.
    Held { sent: Instant },
    /// Taken over by a survivor: never act again.
    Fenced,
    /// A graceful stop has ended the liveness loop after the lanes finished: nothing is left
    /// to act on; the records are purged next.
    Departed,
}

/// This replica's lease (one per process, in `Ctx`).
#[derive(Debug)]
pub(crate) struct Lease {
    state: watch::Sender<State>,
    span: Duration,
    /// The connection acts go out on (none in unit tests: always up).
    client: Option<async_nats::Client>,
}

impl Lease {
    pub(crate) fn new(span: Duration) -> Self {
        Self {
            state: watch::Sender::new(State::Lapsed),
            span,
            client: None,
        }
    }

    /// A lease that is held only while `client` is connected.
    pub(crate) fn on(span: Duration, client: async_nats::Client) -> Self {
        Self {
            client: Some(client),
            ..Self::new(span)
        }
    }

    fn connected(&self) -> bool {
        self.client
            .as_ref()
            .is_none_or(|c| c.connection_state() == async_nats::connection::State::Connected)
    }

    /// A renewal sent at `sent` was stored: the lease runs until `sent` + span.
    pub(crate) fn renewed(&self, sent: Instant) {
        self.state.send_if_modified(|s| match s {
            State::Fenced | State::Departed => false,
            _ => {
                *s = State::Held { sent };
                true
            }
        });
    }

    /// A renewal failed (NATS unreachable): acts wait until one succeeds.
    pub(crate) fn lapse(&self) {
        self.state.send_if_modified(|s| match s {
            State::Held { .. } => {
                *s = State::Lapsed;
                true
            }
            _ => false,
        });
    }

    /// A survivor took this replica over: every act waiting or to come is refused.
    pub(crate) fn fence(&self) {
        self.state.send_replace(State::Fenced);
    }

    /// The liveness loop stopped on a graceful shutdown.
    pub(crate) fn depart(&self) {
        self.state.send_if_modified(|s| match s {
            State::Fenced => false,
            _ => {
                *s = State::Departed;
                true
            }
        });
    }

    /// Waits until this replica may act: at once while the lease is held, after the next
    /// successful renewal when it lapsed; `Err(Fenced)` when it was taken over or has departed.
    pub(crate) async fn hold(&self) -> Result<(), Fenced> {
        let mut rx = self.state.subscribe();
        loop {
            let state = *rx.borrow_and_update();
            match state {
                State::Fenced | State::Departed => return Err(Fenced),
                State::Held { sent } if sent.elapsed() < self.span && self.connected() => {
                    return Ok(())
                }
                State::Held { .. } | State::Lapsed => {}
            }
            if rx.changed().await.is_err() {
                return Err(Fenced);
            }
        }
    }

    /// Whether this replica may act right now (for paths that cannot wait).
    pub(crate) fn held(&self) -> bool {
        matches!(*self.state.borrow(), State::Held { sent } if sent.elapsed() < self.span)
            && self.connected()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPAN: Duration = Duration::from_millis(300);

    /// When a renewal was sent `ago`.
    fn sent(ago: Duration) -> Instant {
        Instant::now().checked_sub(ago).unwrap_or_else(Instant::now)
    }

    /// Whether `hold` settles at once (it never waits on a timer: only on a state change).
    async fn settles(lease: &Lease) -> Option<Result<(), Fenced>> {
        let waiting = lease.hold();
        tokio::pin!(waiting);
        futures::FutureExt::now_or_never(waiting.as_mut())
    }

    #[tokio::test]
    async fn a_fresh_lease_holds_and_a_stale_one_waits_for_the_next_renewal() {
        let lease = Lease::new(SPAN);
        assert!(
            settles(&lease).await.is_none(),
            "nothing before the announce"
        );
        lease.renewed(Instant::now());
        assert!(matches!(settles(&lease).await, Some(Ok(()))));
        assert!(lease.held());
        // A pause longer than the span: the last renewal was sent long ago.
        lease.renewed(sent(SPAN * 5));
        assert!(!lease.held());
        let waiting = lease.hold();
        tokio::pin!(waiting);
        assert!(
            futures::FutureExt::now_or_never(waiting.as_mut()).is_none(),
            "a lapsed lease waits"
        );
        lease.renewed(Instant::now());
        assert!(matches!(waiting.await, Ok(())));
    }

    #[tokio::test]
    async fn a_renewal_counts_from_its_send_not_its_storage() {
        let lease = Lease::new(SPAN);
        // Stored only now (a slow server), sent two spans ago.
        lease.renewed(sent(SPAN * 2));
        assert!(!lease.held());
        assert!(settles(&lease).await.is_none());
    }

    #[tokio::test]
    async fn a_fenced_replica_never_acts_again() {
        let lease = Lease::new(SPAN);
        lease.renewed(sent(SPAN * 5));
        let waiting = lease.hold();
        tokio::pin!(waiting);
        assert!(futures::FutureExt::now_or_never(waiting.as_mut()).is_none());
        lease.fence();
        assert!(waiting.await.is_err(), "the waiting act is refused");
        lease.renewed(Instant::now());
        assert!(!lease.held(), "a renewal after the fence changes nothing");
        assert!(settles(&lease).await.is_some_and(|r| r.is_err()));
    }

    #[tokio::test]
    async fn a_failed_renewal_lapses_the_lease_at_once_and_a_departure_ends_it() {
        let lease = Lease::new(SPAN);
        lease.renewed(Instant::now());
        lease.lapse();
        assert!(!lease.held());
        assert!(settles(&lease).await.is_none());
        lease.depart();
        assert!(settles(&lease).await.is_some_and(|r| r.is_err()));
    }

    /// While the connection is down the lease is not held, however fresh its last renewal:
    /// an act then would wait in the client's buffer and go out after the reconnect, maybe
    /// after a survivor took the lanes over. Back, it is held from the next renewal on.
    #[tokio::test]
    async fn a_lease_is_not_held_while_the_connection_is_down() -> anyhow::Result<()> {
        use async_nats::connection::State as Conn;
        let mut server = turnstile_tests::NatsServer::start().await?;
        let client = server.client().await?;
        let lease = Lease::on(SPAN, client.clone());
        lease.renewed(Instant::now());
        assert!(lease.held());
        server.kill().await?;
        let down = client.clone();
        turnstile_tests::wait_until("the client to see it", Duration::from_secs(10), || {
            let c = down.clone();
            async move { Ok((c.connection_state() != Conn::Connected).then_some(())) }
        })
        .await?;
        lease.renewed(Instant::now());
        assert!(!lease.held(), "a fresh renewal, but the connection is down");
        assert!(settles(&lease).await.is_none(), "acts wait");
        server.restart().await?;
        let up = client.clone();
        turnstile_tests::wait_until("the reconnect", Duration::from_secs(20), || {
            let c = up.clone();
            async move { Ok((c.connection_state() == Conn::Connected).then_some(())) }
        })
        .await?;
        lease.renewed(Instant::now());
        assert!(lease.held());
        assert!(matches!(settles(&lease).await, Some(Ok(()))));
        Ok(())
    }
}
