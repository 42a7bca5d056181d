//! The Prometheus metrics every service serves on `/metrics`, beside `/healthz` and
//! `/readyz` on its `--http` listener. One registry per process, and every family is named
//! here and nowhere else. Label values come from bounded sets only (item kinds, outcomes,
//! reason codes, step kinds): never a session, turn, run or step id, so a fleet of any size
//! keeps a fixed number of series.
//!
//! Each service fills the families of its own work (the lane its turns and deliveries, the
//! broker steps and completions, the scheduler slots, the transport its terminals); the
//! others stay at zero in its exposition.

use std::sync::OnceLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The exposition's content type (OpenMetrics text, which Prometheus scrapes natively).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `kind` label values of the lane families.
pub mod item_kind {
    pub const TURN: &str = "turn";
    pub const DELIVERY: &str = "delivery";
    pub const RUN: &str = "run";
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// The lane item kind: `turn`, `delivery` or `run`.
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `completed`, `failed` or `cancelled`.
    pub outcome: &'static str,
    /// The failure's reason code (`none` for a completed turn).
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabels {
    /// `command`, `external` or `agent`.
    pub kind: &'static str,
    /// `completed`, `failed` or `cancelled`.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoleLabel {
    /// `owner` or `watcher`.
    pub role: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SlotLabel {
    /// `fired`, `late` (fired past its schedule's late threshold; also counted as `fired`),
    /// `skipped` or `missed`.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabel {
    /// The API that refused: `steps` (a step or session token) or `callout` (an agent's
    /// NATS login).
    pub api: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// Which in-process per-session map (`completion_consumers`, `session_specs`, ...).
    pub map: &'static str,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// Reads the size of one in-process map when the metrics are encoded; `None` once its owner
/// is gone (the probe is then dropped).
type Probe = Box<dyn Fn() -> Option<usize> + Send + Sync>;

/// Every family, registered once per process.
pub struct Metrics {
    registry: Registry,
    pub lane_queue_depth: Histogram,
    pub turns_started: Family<KindLabel, Counter>,
    pub turns_ended: Family<OutcomeLabels, Counter>,
    pub turn_duration: Histograms<KindLabel>,
    pub handoff: Histogram,
    pub completions_routed: Family<RoleLabel, Counter>,
    pub completions_handed_over: Counter,
    pub completions_left_pending: Counter,
    pub delivery_batch: Histogram,
    pub steps_ended: Family<StepLabels, Counter>,
    pub slots: Family<SlotLabel, Counter>,
    pub fire_drift: Histogram,
    pub hosts_alive: Gauge,
    pub terminals_died: Counter,
    pub auth_refusals: Family<ApiLabel, Counter>,
    /// Entries of each per-session map a service keeps in memory (R13: a stopped session
    /// leaves none behind), read from the maps at each scrape.
    pub session_state: Family<StateLabel, Gauge>,
    probes: std::sync::Mutex<Vec<(&'static str, Probe)>>,
}

fn seconds() -> Histogram {
    // 1 ms to about 9 hours.
    Histogram::new(exponential_buckets(0.001, 4.0, 15))
}

impl Metrics {
    fn new() -> Self {
        let mut m = Self {
            lane_queue_depth: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            turns_started: Family::default(),
            turns_ended: Family::default(),
            turn_duration: Family::new_with_constructor(seconds as fn() -> Histogram),
            handoff: Histogram::new(exponential_buckets(0.0001, 2.0, 20)),
            completions_routed: Family::default(),
            completions_handed_over: Counter::default(),
            completions_left_pending: Counter::default(),
            delivery_batch: Histogram::new(exponential_buckets(1.0, 2.0, 8)),
            steps_ended: Family::default(),
            slots: Family::default(),
            fire_drift: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            hosts_alive: Gauge::default(),
            terminals_died: Counter::default(),
            auth_refusals: Family::default(),
            session_state: Family::default(),
            probes: std::sync::Mutex::default(),
            registry: Registry::default(),
        };
        let r = &mut m.registry;
        r.register(
            "turnstile_lane_queue_depth",
            "Items waiting on a lane behind the one it takes, observed at each take",
            m.lane_queue_depth.clone(),
        );
        r.register(
            "turnstile_turns_started",
            "Turns dispatched to their transport, by lane item kind",
            m.turns_started.clone(),
        );
        r.register(
            "turnstile_turns_ended",
            "Turns ended, by outcome and reason code",
            m.turns_ended.clone(),
        );
        r.register(
            "turnstile_turn_duration_seconds",
            "From a turn's typing to its recorded end, by lane item kind",
            m.turn_duration.clone(),
        );
        r.register(
            "turnstile_handoff_seconds",
            "From a turn item queued on an idle lane to its dispatch",
            m.handoff.clone(),
        );
        r.register(
            "turnstile_completions_routed",
            "Completions stored for a session that owns or watches the execution",
            m.completions_routed.clone(),
        );
        r.register(
            "turnstile_completions_handed_over",
            "Completions acknowledged after the turn that carried them completed",
            m.completions_handed_over.clone(),
        );
        r.register(
            "turnstile_completions_left_pending",
            "Completions left pending because the turn that carried them failed",
            m.completions_left_pending.clone(),
        );
        r.register(
            "turnstile_delivery_batch_size",
            "Completions carried by one delivery turn",
            m.delivery_batch.clone(),
        );
        r.register(
            "turnstile_steps_ended",
            "Steps recorded as ended, by step kind and outcome",
            m.steps_ended.clone(),
        );
        r.register(
            "turnstile_slots",
            "Schedule slots by outcome (a late slot also counts as fired)",
            m.slots.clone(),
        );
        r.register(
            "turnstile_fire_drift_seconds",
            "From a slot's time to its claim",
            m.fire_drift.clone(),
        );
        r.register(
            "turnstile_hosts_alive",
            "Transport hosts heartbeating, as this replica sees them",
            m.hosts_alive.clone(),
        );
        r.register(
            "turnstile_terminals_died",
            "Agent terminals (tmux panes) found dead while their session was active",
            m.terminals_died.clone(),
        );
        r.register(
            "turnstile_auth_refusals",
            "Calls refused for their credentials, by API",
            m.auth_refusals.clone(),
        );
        r.register(
            "turnstile_session_state_entries",
            "Entries of each in-process per-session map, by map",
            m.session_state.clone(),
        );
        m
    }

    /// Registers `probe` as the size of the per-session map `map`, read at each encode (the
    /// sizes of maps of one name are summed, for several services in one process).
    pub fn probe(
        &self,
        map: &'static str,
        probe: impl Fn() -> Option<usize> + Send + Sync + 'static,
    ) {
        if let Ok(mut probes) = self.probes.lock() {
            probes.push((map, Box::new(probe)));
        }
        let _ = self.session_state.get_or_create(&StateLabel { map });
    }

    /// [`Metrics::probe`] of a map that `owner` holds, read through a weak reference: the probe
    /// is dropped once the owner is.
    pub fn probe_of<T: Send + Sync + 'static>(
        &self,
        map: &'static str,
        owner: &std::sync::Arc<T>,
        size: fn(&T) -> usize,
    ) {
        let owner = std::sync::Arc::downgrade(owner);
        self.probe(map, move || owner.upgrade().map(|o| size(&o)));
    }

    fn read_probes(&self) {
        let Ok(mut probes) = self.probes.lock() else {
            return;
        };
        let mut sizes: std::collections::HashMap<&'static str, usize> = Default::default();
        probes.retain(|(map, probe)| match probe() {
            Some(n) => {
                *sizes.entry(map).or_default() += n;
                true
            }
            None => {
                sizes.entry(map).or_default();
                false
            }
        });
        for (map, n) in sizes {
            self.session_state
                .get_or_create(&StateLabel { map })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// The exposition of every family (OpenMetrics text).
    pub fn encode(&self) -> String {
        self.read_probes();
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "encode metrics");
        }
        out
    }

    pub fn turn_ended(&self, outcome: &'static str, reason: &str) {
        self.turns_ended
            .get_or_create(&OutcomeLabels {
                outcome,
                reason: reason.to_string(),
            })
            .inc();
    }
}

/// This process's metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_exposed_with_bounded_labels() {
        let m = Metrics::new();
        m.turns_started
            .get_or_create(&KindLabel { kind: "turn" })
            .inc();
        m.turn_ended("failed", "agent_exited");
        m.handoff.observe(0.002);
        let text = m.encode();
        assert!(
            text.contains("turnstile_turns_started_total{kind=\"turn\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "turnstile_turns_ended_total{outcome=\"failed\",reason=\"agent_exited\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("turnstile_handoff_seconds_count 1"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn probes_are_read_at_each_encode_and_summed_by_map() {
        let m = Metrics::new();
        let size = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(3));
        let read = size.clone();
        m.probe("specs", move || {
            Some(read.load(std::sync::atomic::Ordering::Relaxed))
        });
        m.probe("specs", || Some(2));
        let owner = std::sync::Arc::new(7usize);
        m.probe_of("gone", &owner, |n| *n);
        let line = |text: &str, map: &str| {
            let prefix = format!("turnstile_session_state_entries{{map=\"{map}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix).map(str::to_string))
        };
        let text = m.encode();
        assert_eq!(line(&text, "specs").as_deref(), Some("5"), "{text}");
        assert_eq!(line(&text, "gone").as_deref(), Some("7"), "{text}");
        size.store(0, std::sync::atomic::Ordering::Relaxed);
        drop(owner);
        let text = m.encode();
        assert_eq!(line(&text, "specs").as_deref(), Some("2"), "{text}");
        assert_eq!(line(&text, "gone").as_deref(), Some("0"), "{text}");
    }
}
