//! The ticker's view of `ts_schedules`, kept current by a watch instead of re-reading the
//! bucket every pass (a read per schedule per pass made 1,000 schedules fire ~1 s late). Each
//! entry carries its parsed cron and the first slot after its cursor, so a pass picks the due
//! schedules without touching the store and the loop knows when to wake.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use turnstile_shared::schedules::ScheduleRecord;

use crate::cron::CronSpec;

/// A schedule as last seen, with what the ticker derives from it.
pub(crate) struct Entry {
    pub record: ScheduleRecord,
    /// The record's revision in the bucket (compare-and-set writes start from it).
    pub revision: u64,
    pub cron: CronSpec,
    /// The first slot after the cursor: the schedule is due once this has passed.
    pub next: Option<DateTime<Utc>>,
    /// After a failed pass: not before this instant.
    pub retry_at: Option<DateTime<Utc>>,
}

#[derive(Default)]
pub(crate) struct Table {
    entries: HashMap<String, Entry>,
}

impl Table {
    /// A schedule's current record (from the watch or a write of this replica): kept only if
    /// newer than what is held. An unreadable cron is logged and the schedule left out.
    pub fn upsert(&mut self, record: ScheduleRecord, revision: u64) {
        let name = record.spec.name.clone();
        if let Some(e) = self.entries.get_mut(&name) {
            if e.revision >= revision {
                return;
            }
            if e.record.spec.cron == record.spec.cron && e.record.spec.tz == record.spec.tz {
                e.next = e.cron.next_after(record.cursor);
                e.record = record;
                e.revision = revision;
                e.retry_at = None;
                return;
            }
        }
        match CronSpec::parse(&record.spec.cron, &record.spec.tz) {
            Ok(cron) => {
                let next = cron.next_after(record.cursor);
                self.entries.insert(
                    name,
                    Entry {
                        record,
                        revision,
                        cron,
                        next,
                        retry_at: None,
                    },
                );
            }
            Err(e) => {
                tracing::error!(schedule = %name, error = %e, "unreadable schedule; skipped");
                self.entries.remove(&name);
            }
        }
    }

    /// The schedule was deleted (at `revision`).
    pub fn remove(&mut self, name: &str, revision: u64) {
        if self
            .entries
            .get(name)
            .is_some_and(|e| e.revision < revision)
        {
            self.entries.remove(name);
        }
    }

    /// A pass over `name` failed: look again in a second.
    pub fn retry_later(&mut self, name: &str, now: DateTime<Utc>) {
        if let Some(e) = self.entries.get_mut(name) {
            e.retry_at = Some(now + chrono::TimeDelta::seconds(1));
        }
    }

    /// The schedules with a slot due at `now`, and (when `buffered_too`) those holding a
    /// buffered slot, whose blocker may have ended.
    pub fn due(&self, now: DateTime<Utc>, buffered_too: bool) -> Vec<(ScheduleRecord, u64)> {
        self.entries
            .values()
            .filter(|e| e.retry_at.is_none_or(|r| r <= now))
            .filter(|e| {
                e.next.is_some_and(|n| n <= now) || (buffered_too && e.record.buffered.is_some())
            })
            .map(|e| (e.record.clone(), e.revision))
            .collect()
    }

    /// When the loop must look next: the earliest slot or retry.
    pub fn wake_at(&self) -> Option<DateTime<Utc>> {
        self.entries
            .values()
            .filter_map(|e| match (e.next, e.retry_at) {
                (Some(n), Some(r)) => Some(n.max(r)),
                (n, None) => n,
                (None, Some(_)) => None,
            })
            .min()
    }

    pub fn has_buffered(&self) -> bool {
        self.entries.values().any(|e| e.record.buffered.is_some())
    }

    /// Every schedule's record and cron, for the slot audit.
    pub fn snapshot(&self) -> Vec<(ScheduleRecord, CronSpec)> {
        self.entries
            .values()
            .map(|e| (e.record.clone(), e.cron.clone()))
            .collect()
    }

    pub fn cron(&self, name: &str) -> Option<&CronSpec> {
        self.entries.get(name).map(|e| &e.cron)
    }
}
