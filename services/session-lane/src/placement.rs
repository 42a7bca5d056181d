//! Where a new session goes, without reading the store: the live transport hosts as this
//! replica sees them (kept by `host_watch`'s watch on `ts_hosts`) and how many active
//! sessions each serves (kept by the supervisor, which follows every session anyway). Reading
//! every host and every session per create made creation cost grow with the fleet (32 a
//! second at 1,000 sessions).
//!
//! A host is live while its heartbeats keep arriving: its last one is younger than the hosts
//! bucket's age limit (the host TTL it was provisioned with), judged by the server's timestamp
//! of the message.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use turnstile_shared::records::HostRecord;
use turnstile_shared::{HostName, SessionId};

#[derive(Default)]
pub(crate) struct Placement {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Each host's last heartbeat and when the server stored it.
    hosts: HashMap<HostName, (HostRecord, DateTime<Utc>)>,
    /// Whether the watch has delivered the bucket's state once.
    ready: bool,
    sessions: HashMap<SessionId, HostName>,
    counts: HashMap<HostName, usize>,
}

impl Placement {
    /// The live hosts, or `None` until the watch has caught up (the caller reads the bucket).
    pub fn live(&self, ttl: Duration) -> Option<Vec<HostRecord>> {
        self.with_live(ttl, |hosts| hosts.cloned().collect())
    }

    /// How many hosts are live, or `None` until the watch has caught up.
    pub fn live_count(&self, ttl: Duration) -> Option<usize> {
        self.with_live(ttl, |hosts| hosts.count())
    }

    fn with_live<R>(
        &self,
        ttl: Duration,
        f: impl FnOnce(&mut dyn Iterator<Item = &HostRecord>) -> R,
    ) -> Option<R> {
        let inner = self.inner.lock().ok()?;
        if !inner.ready {
            return None;
        }
        let ttl = chrono::TimeDelta::from_std(ttl).unwrap_or(chrono::TimeDelta::MAX);
        let now = Utc::now();
        let mut live = inner
            .hosts
            .values()
            .filter(|(_, at)| now - *at < ttl)
            .map(|(r, _)| r);
        Some(f(&mut live))
    }

    /// Active sessions placed on `host`.
    pub fn count(&self, host: &HostName) -> usize {
        self.inner
            .lock()
            .map(|i| i.counts.get(host).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    /// The active sessions placed on `host`, in id order.
    pub fn sessions_on(&self, host: &HostName) -> Vec<SessionId> {
        let mut out: Vec<SessionId> = self
            .inner
            .lock()
            .map(|i| {
                i.sessions
                    .iter()
                    .filter(|(_, h)| *h == host)
                    .map(|(s, _)| s.clone())
                    .collect()
            })
            .unwrap_or_default();
        out.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        out
    }

    /// How many active sessions this replica knows of.
    pub fn sessions(&self) -> usize {
        self.inner.lock().map(|i| i.sessions.len()).unwrap_or(0)
    }

    /// Whether `session` is active, as far as this replica's watch has seen.
    pub fn knows(&self, session: &SessionId) -> bool {
        self.inner
            .lock()
            .map(|i| i.sessions.contains_key(session))
            .unwrap_or(true)
    }

    /// `session` is active on `host`, or (with `None`) no longer active.
    pub fn session(&self, session: &SessionId, host: Option<&HostName>) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        let before = match host {
            Some(h) => inner.sessions.insert(session.clone(), h.clone()),
            None => inner.sessions.remove(session),
        };
        if let Some(b) = before {
            if let Some(n) = inner.counts.get_mut(&b) {
                *n = n.saturating_sub(1);
            }
        }
        if let Some(h) = host {
            *inner.counts.entry(h.clone()).or_default() += 1;
        }
    }

    pub(crate) fn heartbeat(&self, record: HostRecord, at: DateTime<Utc>, caught_up: bool) {
        if let Ok(mut inner) = self.inner.lock() {
            inner.hosts.insert(record.name.clone(), (record, at));
            inner.ready |= caught_up;
        }
    }

    pub(crate) fn forget(&self, host: &str) {
        if let Ok(mut inner) = self.inner.lock() {
            inner.hosts.retain(|h, _| h.as_str() != host);
        }
    }
}
