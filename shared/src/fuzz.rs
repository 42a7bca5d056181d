//! A seeded mutation fuzzer for every decoder of the wire and the records (R15): valid
//! payloads of each kind a component reads (lane items, transport commands, step work, ends,
//! API requests, records) are mutated, byte by byte and value by value, and decoded. Decoding
//! must never panic, and a refusal must be an error that says something. The unit test runs a
//! bounded number of rounds; `scripts/fuzz.sh` runs it for longer (`TURNSTILE_FUZZ_ROUNDS`,
//! `TURNSTILE_FUZZ_SEED`). It is not coverage-guided (no such fuzzer runs on the stable
//! toolchain here); the mutations aim at what JSON decoders trip on: types swapped, fields
//! dropped or unknown, versions out of range, truncation, deep nesting, huge numbers.

use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use crate::api::{CreateSession, SendTurn, SessionRef};
use crate::envelope::Envelope;
use crate::execution::ExecutionRecord;
use crate::lane::{LaneItem, TurnItem};
use crate::records::{SessionRecord, StartCommand, StopCommand, TurnCommand, TurnRecord};
use crate::runs::{RunRecord, RunRef, StartRun};
use crate::schedules::{ScheduleRecord, ScheduleSpec, SlotRecord};
use crate::step_api::{Ended, ExecRef, StartStep, StepReport, StepWorkItem};
use crate::{SessionId, StepId, TurnId};

/// SplitMix64 (as the chaos campaign's): the whole state is the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % (n.max(1) as u64)) as usize
    }
}

/// Tokens JSON decoders trip on.
const TOKENS: [&str; 16] = [
    "{",
    "}",
    "[",
    "]",
    "\"",
    ":",
    ",",
    "null",
    "true",
    "-1",
    "1e999",
    "18446744073709551616",
    "\"\\u0000\"",
    "\"\\ud800\"",
    "0.5",
    "\"v\":2",
];

/// Values swapped in for a leaf or a field.
fn odd_value(rng: &mut Rng) -> Value {
    match rng.below(10) {
        0 => Value::Null,
        1 => json!(-1),
        2 => json!(u64::MAX),
        3 => json!(1.5),
        4 => json!(""),
        5 => json!("x".repeat(70_000)),
        6 => json!([]),
        7 => json!({}),
        8 => json!(true),
        _ => json!("ses_../../etc"),
    }
}

/// One mutation of `seed`: of its bytes, or of one of its values.
fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    match rng.below(8) {
        0 if !bytes.is_empty() => {
            let i = rng.below(bytes.len());
            bytes[i] ^= 1 << rng.below(8);
        }
        1 => {
            let i = rng.below(bytes.len() + 1);
            let t = TOKENS[rng.below(TOKENS.len())].as_bytes();
            bytes.splice(i..i, t.iter().copied());
        }
        2 if !bytes.is_empty() => {
            let at = rng.below(bytes.len());
            bytes.truncate(at);
        }
        3 if bytes.len() > 2 => {
            let a = rng.below(bytes.len());
            let b = (a + 1 + rng.below(16)).min(bytes.len());
            bytes.drain(a..b);
        }
        4 => {
            let depth = 1 + rng.below(300);
            bytes = format!("{}{}", "[".repeat(depth), "]".repeat(depth)).into_bytes();
        }
        _ => {
            if let Ok(mut v) = serde_json::from_slice::<Value>(&bytes) {
                mutate_value(rng, &mut v);
                bytes = serde_json::to_vec(&v).unwrap_or_default();
            }
        }
    }
    bytes
}

/// Swaps, drops or adds one value somewhere in `v`.
fn mutate_value(rng: &mut Rng, v: &mut Value) {
    match v {
        Value::Object(map) if !map.is_empty() => {
            let keys: Vec<String> = map.keys().cloned().collect();
            let key = keys[rng.below(keys.len())].clone();
            match rng.below(4) {
                0 => {
                    map.remove(&key);
                }
                1 => {
                    map.insert(format!("unknown_{}", rng.below(100)), odd_value(rng));
                }
                2 => {
                    map.insert(key, odd_value(rng));
                }
                _ => {
                    if let Some(inner) = map.get_mut(&key) {
                        mutate_value(rng, inner);
                    }
                }
            }
        }
        Value::Array(items) if !items.is_empty() => {
            let i = rng.below(items.len());
            mutate_value(rng, &mut items[i]);
        }
        other => *other = odd_value(rng),
    }
}

/// A decoder under test: decodes, and on refusal returns the error's text.
type Decoder = fn(&[u8]) -> Result<(), String>;

fn plain<T: DeserializeOwned>(bytes: &[u8]) -> Result<(), String> {
    serde_json::from_slice::<T>(bytes)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn enveloped<T: DeserializeOwned>(bytes: &[u8]) -> Result<(), String> {
    Envelope::decode(bytes)
        .and_then(|e| e.data_as::<T>())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn lane_item(bytes: &[u8]) -> Result<(), String> {
    LaneItem::decode(bytes, &lane_session())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn lane_session() -> SessionId {
    "ses_fuzz".parse().unwrap_or_default()
}

/// Every decoder with a valid payload of its kind.
fn targets() -> Vec<(&'static str, Decoder, Vec<u8>)> {
    let session = lane_session();
    let turn = TurnId::new();
    let step = StepId::new();
    let env = |e: Result<Envelope, crate::EnvelopeError>| {
        e.and_then(|e| e.encode())
            .map(|b| b.to_vec())
            .unwrap_or_default()
    };
    let lane = LaneItem::Turn(TurnItem {
        turn: turn.clone(),
        text: "hello".into(),
        recorded: None,
    });
    let command = TurnCommand {
        session: session.clone(),
        turn: turn.clone(),
        text: "hello".into(),
        delivery: None,
        known: None,
        unrecorded: false,
    };
    let caller = json!({"session": session, "token": "secret"});
    let started = serde_json::to_value(StepReport {
        step: step.clone(),
        token: "t".into(),
        report: crate::step_api::Report::Started { worker: "w".into() },
    })
    .unwrap_or_default();
    let work = json!({"step": step, "token": "t", "session": session, "name": "n",
        "kind": "command", "argv": ["true"], "host": "h1"});
    let record = json!({"id": step, "kind": "step", "name": "n", "scope": "session",
        "session": session, "owner": session, "created_at": "2026-12-04T00:00:00Z",
        "children": [], "status": "queued"});
    let bytes = |v: Value| serde_json::to_vec(&v).unwrap_or_default();
    vec![
        (
            "lane item",
            lane_item as Decoder,
            env(lane.to_envelope(&session)),
        ),
        (
            "turn command",
            enveloped::<TurnCommand>,
            env(command.envelope()),
        ),
        (
            "start command",
            enveloped::<StartCommand>,
            env(Envelope::new("start", &json!({"session": session}))),
        ),
        (
            "stop command",
            enveloped::<StopCommand>,
            env(Envelope::new("stop", &json!({"session": session}))),
        ),
        (
            "step work",
            enveloped::<StepWorkItem>,
            env(Envelope::new("step.work", &work)),
        ),
        (
            "end",
            enveloped::<Ended>,
            env(Ended::cancelled(step.clone().into(), "cancelled", None).envelope()),
        ),
        (
            "step start",
            plain::<StartStep>,
            bytes(
                json!({"caller": caller, "name": "n", "work": {"kind": "command", "argv": ["true"]}}),
            ),
        ),
        ("step report", plain::<StepReport>, bytes(started)),
        ("exec ref", plain::<ExecRef>, bytes(json!({"id": step}))),
        (
            "session create",
            plain::<CreateSession>,
            bytes(json!({"agent": "mock", "name": "n"})),
        ),
        (
            "session send",
            plain::<SendTurn>,
            bytes(json!({"session": session, "text": "hi"})),
        ),
        (
            "session ref",
            plain::<SessionRef>,
            bytes(json!({"session": session})),
        ),
        (
            "run start",
            plain::<StartRun>,
            bytes(json!({"session": session, "messages": ["a"]})),
        ),
        ("run ref", plain::<RunRef>, bytes(json!({"run": "run_x"}))),
        (
            "schedule",
            plain::<ScheduleSpec>,
            bytes(
                json!({"name": "n", "cron": "* * * * *", "tz": "UTC", "session": session,
                "messages": ["a"]}),
            ),
        ),
        ("execution record", plain::<ExecutionRecord>, bytes(record)),
        (
            "turn record",
            plain::<TurnRecord>,
            bytes(json!({"id": turn, "session": session, "text": "t",
                "queued_at": "2026-12-04T00:00:00Z", "status": "queued"})),
        ),
        (
            "session record",
            plain::<SessionRecord>,
            bytes(
                json!({"id": session, "name": "n", "agent": "mock", "host": "h1",
                "token": "t", "created_at": "2026-12-04T00:00:00Z", "state": "active"}),
            ),
        ),
        (
            "run record",
            plain::<RunRecord>,
            bytes(
                json!({"id": "run_x", "session": session, "created_at": "2026-12-04T00:00:00Z",
                "messages": ["a"], "status": "queued"}),
            ),
        ),
        (
            "slot record",
            plain::<SlotRecord>,
            bytes(json!({"schedule": "n", "slot": "2026-12-04T00:00:00Z",
                "recorded_at": "2026-12-04T00:00:00Z", "outcome": "missed", "reason": "r"})),
        ),
        (
            "schedule record",
            plain::<ScheduleRecord>,
            bytes(
                json!({"name": "n", "cron": "* * * * *", "tz": "UTC", "session": session,
                "messages": ["a"], "created_at": "2026-12-04T00:00:00Z",
                "cursor": "2026-12-04T00:00:00Z"}),
            ),
        ),
    ]
}

/// Runs `rounds` mutations of every target from `seed`; returns how many were refused.
fn fuzz(seed: u64, rounds: usize) -> usize {
    let mut rng = Rng(seed);
    let mut refused = 0;
    for (name, decode, valid) in targets() {
        assert!(
            decode(&valid).is_ok(),
            "{name}: the valid payload is refused: {:?} ({})",
            decode(&valid),
            String::from_utf8_lossy(&valid)
        );
        for _ in 0..rounds {
            let input = mutate(&mut rng, &valid);
            if let Err(why) = decode(&input) {
                assert!(!why.trim().is_empty(), "{name}: a refusal without a reason");
                refused += 1;
            }
        }
    }
    refused
}

#[test]
fn every_decoder_refuses_mutated_input_with_a_reason_and_never_panics() {
    let seed = std::env::var("TURNSTILE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let rounds = std::env::var("TURNSTILE_FUZZ_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000);
    let refused = fuzz(seed, rounds);
    // The mutations reach the decoders' refusals, not only inputs they accept.
    assert!(
        refused > rounds,
        "only {refused} of the mutated inputs were refused"
    );
}
