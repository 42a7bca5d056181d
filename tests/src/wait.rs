//! Bounded polling for test conditions that have no event to subscribe to.
//!
//! Prefer waiting on a real event (a NATS message, a process exit); [`wait_until`] is the
//! fallback for state that can only be observed by asking, and it always has a deadline so a
//! broken test fails with a message instead of hanging.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

const FIRST_INTERVAL: Duration = Duration::from_millis(25);
const MAX_INTERVAL: Duration = Duration::from_millis(200);

/// Polls `check` until it returns `Ok(Some(v))` or the deadline passes.
///
/// `check` runs at least once. Between attempts the pause grows from 25 ms to 200 ms. An
/// attempt still running at the deadline is cancelled. `Ok(None)` and `Err(_)` both mean
/// "not yet"; the error returned on timeout names `what` and the last error (or that the
/// last attempt returned `None`).
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let start = Instant::now();
    let deadline = start + timeout;
    let mut interval = FIRST_INTERVAL;
    let mut attempts = 0u32;

    loop {
        attempts += 1;
        let remaining = deadline.saturating_duration_since(Instant::now());
        let last = match tokio::time::timeout(remaining, check()).await {
            Ok(Ok(Some(value))) => return Ok(value),
            Ok(Ok(None)) => "last check returned None".to_string(),
            Ok(Err(err)) => format!("last error: {err:#}"),
            Err(_) => "last check was still running at the deadline".to_string(),
        };

        let now = Instant::now();
        if now >= deadline {
            anyhow::bail!(
                "timed out after {:?} ({attempts} attempts) waiting for {what}; {last}",
                now - start
            );
        }
        tokio::time::sleep(interval.min(deadline - now)).await;
        interval = (interval * 2).min(MAX_INTERVAL);
    }
}

/// Waits until every session's lane consumer has at least `replicas` pull requests waiting
/// (each session-lane replica keeps one on every lane): the moment a replica joined can be
/// relied on, before a fault test kills the one holding the lanes.
pub async fn wait_lanes_pulled(
    js: &async_nats::jetstream::Context,
    sessions: &[&turnstile_shared::SessionId],
    replicas: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    use turnstile_shared::subjects;
    let lanes = js.get_stream_no_info(subjects::LANE_STREAM).await?;
    for s in sessions {
        let name = subjects::lane_consumer(s);
        wait_until("every replica pulling on the lane", timeout, || {
            let lanes = lanes.clone();
            let name = name.clone();
            async move {
                let info = lanes
                    .consumer_info(&name)
                    .await
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                Ok((info.num_waiting as usize >= replicas).then_some(()))
            }
        })
        .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn returns_the_value_once_ready() {
        let calls = AtomicU32::new(0);
        let got = wait_until("third call", Duration::from_secs(5), || async {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 2 {
                anyhow::bail!("transient");
            }
            Ok((n >= 3).then_some(n))
        })
        .await
        .unwrap();
        assert_eq!(got, 3);
    }

    #[tokio::test]
    async fn times_out_naming_what_and_the_last_error() {
        let err = wait_until::<(), _, _>("the impossible", Duration::from_millis(120), || async {
            anyhow::bail!("still broken")
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("the impossible"), "{err}");
        assert!(err.contains("still broken"), "{err}");
    }

    #[tokio::test]
    async fn a_hanging_check_is_cut_off_at_the_deadline() {
        let started = Instant::now();
        let err = wait_until::<(), _, _>("a hang", Duration::from_millis(100), || async {
            std::future::pending::<anyhow::Result<Option<()>>>().await
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("still running"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
