//! The records of running steps as this replica last wrote them (taken by a worker, then
//! each heartbeat), with their revisions. A worker's heartbeat and its end report then write
//! from here, without reading the record first: for the end, one round trip off the
//! completion path. (`started` and a report that finds no entry write from the API's own
//! read, never reading twice.)
//!
//! Nothing here can be stale in a way that matters: the revision is the record's identity,
//! and the end's compare-and-set succeeds only if nothing wrote the record since. An entry
//! another writer made stale (another replica's heartbeat, a cancellation, a child step
//! appended) fails that write, and the record is read then: it costs the read it would have
//! saved, and the first end still wins. The report's token is checked against the entry's
//! record as against a read one (tokens never change).
//!
//! Bounded: an entry is dropped when its end is reported or recorded here; steps whose end
//! this replica never sees (another replica recorded it, the worker died) are dropped all at
//! once when the table reaches [`CAP`], which costs each live step one read.

use std::collections::HashMap;
use std::sync::Mutex;

use turnstile_shared::execution::ExecutionRecord;
use turnstile_shared::ExecutionId;

/// Entries held at most (a record is about a kilobyte).
pub(crate) const CAP: usize = 4096;

#[derive(Default)]
pub(crate) struct Running {
    records: Mutex<HashMap<ExecutionId, (ExecutionRecord, u64)>>,
}

impl Running {
    /// Keeps `record` at `revision` as this replica just wrote it, while it runs.
    pub(crate) fn remember(&self, record: &ExecutionRecord, revision: u64) {
        let Ok(mut m) = self.records.lock() else {
            return;
        };
        if record.status.is_terminal() {
            m.remove(&record.id);
            return;
        }
        if m.len() >= CAP && !m.contains_key(&record.id) {
            m.clear();
        }
        m.insert(record.id.clone(), (record.clone(), revision));
    }

    /// The entry of `execution`, kept (a heartbeat writes it again).
    pub(crate) fn get(&self, execution: &ExecutionId) -> Option<(ExecutionRecord, u64)> {
        self.records.lock().ok()?.get(execution).cloned()
    }

    /// Takes the entry of `execution` (its end is being reported).
    pub(crate) fn take(&self, execution: &ExecutionId) -> Option<(ExecutionRecord, u64)> {
        self.records.lock().ok()?.remove(execution)
    }

    /// Drops the entry of `execution` (its end was recorded).
    pub(crate) fn forget(&self, execution: &ExecutionId) {
        if let Ok(mut m) = self.records.lock() {
            m.remove(execution);
        }
    }

    /// Entries held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.records.lock().map(|m| m.len()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnstile_shared::execution::ExecStatus;

    fn running() -> ExecutionRecord {
        ExecutionRecord {
            id: turnstile_shared::StepId::new().into(),
            kind: turnstile_shared::execution::ExecKind::Step,
            name: "job".into(),
            parent: None,
            scope: Default::default(),
            session: turnstile_shared::SessionId::new(),
            owner: None,
            watchers: Vec::new(),
            created_at: chrono::Utc::now(),
            work: None,
            token: None,
            children: Vec::new(),
            handed_over: Vec::new(),
            status: ExecStatus::Running {
                started_at: chrono::Utc::now(),
                worker: Some("w".into()),
                heartbeat_at: None,
            },
        }
    }

    #[test]
    fn a_running_record_is_kept_until_taken_and_an_ended_one_is_not() {
        let t = Running::default();
        let r = running();
        t.remember(&r, 7);
        assert_eq!(
            t.get(&r.id).map(|(_, rev)| rev),
            Some(7),
            "a heartbeat keeps it"
        );
        assert_eq!(t.take(&r.id).map(|(_, rev)| rev), Some(7));
        assert!(t.take(&r.id).is_none(), "taken once");

        t.remember(&r, 8);
        let mut ended = r.clone();
        ended.status = ExecStatus::Cancelled {
            started_at: None,
            ended_at: chrono::Utc::now(),
            reason: "x".into(),
        };
        t.remember(&ended, 9);
        assert!(t.take(&r.id).is_none(), "an ended record drops its entry");

        t.remember(&r, 10);
        t.forget(&r.id);
        assert!(t.take(&r.id).is_none(), "forgotten");
    }

    #[test]
    fn the_table_is_bounded() {
        let t = Running::default();
        for _ in 0..CAP + 10 {
            t.remember(&running(), 1);
        }
        assert!(t.len() <= CAP, "{} entries", t.len());
    }
}
