//! The one retry policy: a capped exponential backoff. Every loop that retries after an error
//! or polls for a state (lane pull streams, consumers, event re-publishes, step reports, the
//! mock adapter's pane polls) takes its delays from a [`Backoff`], so the policies are named,
//! bounded and tested in one place.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Delays that start at `first` and double up to `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

impl Backoff {
    pub const fn new(first: Duration, max: Duration) -> Self {
        Self { first, max }
    }

    /// A fresh sequence of delays under this policy.
    pub fn delays(&self) -> Delays {
        Delays {
            policy: *self,
            next: self.first.min(self.max),
        }
    }
}

/// One retry loop's position in its [`Backoff`]: an endless iterator of delays.
#[derive(Debug, Clone)]
pub struct Delays {
    policy: Backoff,
    next: Duration,
}

impl Delays {
    /// Sleeps for the next delay.
    pub async fn wait(&mut self) {
        let d = self.next_delay();
        tokio::time::sleep(d).await;
    }

    /// Sleeps for the next delay unless `cancel` fires first; false if it did.
    pub async fn wait_or_cancel(&mut self, cancel: &CancellationToken) -> bool {
        let d = self.next_delay();
        tokio::select! {
            biased;
            _ = cancel.cancelled() => false,
            _ = tokio::time::sleep(d) => true,
        }
    }

    /// Starts again from the first delay (after a success).
    pub fn reset(&mut self) {
        self.next = self.policy.first.min(self.policy.max);
    }

    fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(self.policy.max);
        d
    }
}

impl Iterator for Delays {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.next_delay())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_and_resets() {
        let ms = Duration::from_millis;
        let mut d = Backoff::new(ms(100), ms(500)).delays();
        let first: Vec<_> = d.by_ref().take(5).collect();
        assert_eq!(first, vec![ms(100), ms(200), ms(400), ms(500), ms(500)]);
        d.reset();
        assert_eq!(d.next(), Some(ms(100)));
        let mut capped = Backoff::new(ms(900), ms(500)).delays();
        assert_eq!(capped.next(), Some(ms(500)));
    }

    #[tokio::test]
    async fn a_cancelled_wait_returns_at_once() {
        let cancel = CancellationToken::new();
        cancel.cancel();
        let mut d = Backoff::new(Duration::from_secs(60), Duration::from_secs(60)).delays();
        assert!(!d.wait_or_cancel(&cancel).await);
    }
}
