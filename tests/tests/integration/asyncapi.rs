//! `docs/asyncapi.yaml` against the code and the real events:
//! - the document is a valid AsyncAPI 3.0 document (the `roas-asyncapi` validator, every `$ref`
//!   local and resolving), names every event kind of the registry (`EventKind`) as a message,
//!   and each of its examples validates against its own message's payload schema;
//! - every event a stack publishes goes to a subject one of its channels describes, and its
//!   payload validates against that channel's message (JSON Schema, draft 7, formats checked).
//!   [`check_stack`] runs at the end of every passing stack test (`stack::report`), so the
//!   whole suite's events are held to the document; a dedicated test drives a stack through
//!   most kinds on purpose.

use std::collections::{BTreeSet, HashMap};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use turnstile_shared::events::EventKind;
use turnstile_shared::subjects;
use turnstile_tests::workspace_root;

use crate::stack::Stack;

/// A channel: its address split on dots (`{param}` matches one token), and its message.
struct Channel {
    id: String,
    address: Vec<String>,
    message: String,
}

/// The document, compiled once per test binary.
struct Spec {
    channels: Vec<Channel>,
    /// Message key (`TurnCompleted`) to (event type, payload validator).
    messages: HashMap<String, (String, jsonschema::Validator)>,
}

fn document() -> Result<Value> {
    let path = workspace_root().join("docs").join("asyncapi.yaml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    serde_norway::from_str(&text).with_context(|| format!("{} is not YAML", path.display()))
}

/// A validator of one message's payload: the whole document as the schema's root, so its
/// `#/components/...` references resolve, with a root `$ref` to the payload (draft 7: the
/// reference stands for the whole schema).
fn payload_validator(doc: &Value, message: &str) -> Result<jsonschema::Validator> {
    let mut root = doc.clone();
    root["$ref"] = Value::String(format!("#/components/messages/{message}/payload"));
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft7)
        .should_validate_formats(true)
        .build(&root)
        .map_err(|e| anyhow::anyhow!("the payload schema of {message} does not compile: {e}"))
}

/// The target of a local `$ref` (`#/channels/x/messages/y`).
fn pointer<'a>(doc: &'a Value, reference: &str) -> Result<&'a Value> {
    let path = reference
        .strip_prefix('#')
        .with_context(|| format!("{reference} is not a local reference"))?;
    doc.pointer(path)
        .with_context(|| format!("{reference} resolves to nothing"))
}

fn compile(doc: &Value) -> Result<Spec> {
    let mut messages = HashMap::new();
    for (key, message) in doc["components"]["messages"]
        .as_object()
        .context("no components.messages")?
    {
        let name = message["name"]
            .as_str()
            .with_context(|| format!("message {key} has no name"))?;
        messages.insert(
            key.clone(),
            (name.to_string(), payload_validator(doc, key)?),
        );
    }
    let mut channels = Vec::new();
    for (id, channel) in doc["channels"].as_object().context("no channels")? {
        let address = channel["address"]
            .as_str()
            .with_context(|| format!("channel {id} has no address"))?;
        let refs: Vec<&Value> = channel["messages"]
            .as_object()
            .with_context(|| format!("channel {id} has no messages"))?
            .values()
            .collect();
        ensure!(
            refs.len() == 1,
            "channel {id} has {} messages, not one",
            refs.len()
        );
        let target = refs[0]["$ref"]
            .as_str()
            .with_context(|| format!("channel {id}'s message is not a $ref"))?;
        let message = target
            .strip_prefix("#/components/messages/")
            .with_context(|| format!("channel {id} points at {target}"))?;
        ensure!(
            messages.contains_key(message),
            "channel {id}: no message {message}"
        );
        channels.push(Channel {
            id: id.clone(),
            address: address.split('.').map(str::to_string).collect(),
            message: message.to_string(),
        });
    }
    Ok(Spec { channels, messages })
}

fn spec() -> Result<&'static Spec> {
    static SPEC: OnceLock<Result<Spec, String>> = OnceLock::new();
    SPEC.get_or_init(|| {
        document()
            .and_then(|d| compile(&d))
            .map_err(|e| format!("{e:#}"))
    })
    .as_ref()
    .map_err(|e| anyhow::anyhow!("docs/asyncapi.yaml: {e}"))
}

fn matches(address: &[String], subject: &[&str]) -> bool {
    address.len() == subject.len()
        && address
            .iter()
            .zip(subject)
            .all(|(a, s)| (a.starts_with('{') && a.ends_with('}')) || a == s)
}

/// The subject's `{session}`, `{host}` and `{schedule}` tokens are what the event is about.
fn parameters_agree(address: &[String], subject: &[&str], event: &Value) -> Result<()> {
    for (a, s) in address.iter().zip(subject) {
        let said = match a.as_str() {
            "{session}" => &event["session"],
            "{host}" => &event["host"],
            "{schedule}" => &event["data"]["schedule"],
            _ => continue,
        };
        ensure!(
            said.as_str() == Some(*s),
            "{a} is {s} in the subject but {said} in the event"
        );
    }
    Ok(())
}

/// Checks one event against the document; returns its type.
pub fn check_event(subject: &str, payload: &[u8]) -> Result<String> {
    let spec = spec()?;
    let event: Value = serde_json::from_slice(payload)
        .with_context(|| format!("the event on {subject} is not JSON"))?;
    let kind = event["type"].as_str().unwrap_or_default().to_string();
    let tokens: Vec<&str> = subject.split('.').collect();
    let channel = spec
        .channels
        .iter()
        .find(|c| matches(&c.address, &tokens))
        .with_context(|| format!("no channel of docs/asyncapi.yaml describes {subject}"))?;
    parameters_agree(&channel.address, &tokens, &event)
        .with_context(|| format!("the {kind} event on {subject}"))?;
    let (name, validator) = &spec.messages[&channel.message];
    ensure!(
        *name == kind,
        "{subject}: channel {} carries {name}, the event is {kind:?}",
        channel.id
    );
    let errors: Vec<String> = validator
        .iter_errors(&event)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    ensure!(
        errors.is_empty(),
        "the {kind} event on {subject} does not match docs/asyncapi.yaml:\n  {}\nevent: {event}",
        errors.join("\n  ")
    );
    Ok(kind)
}

/// Checks every stored event of a stack; returns the kinds seen.
pub async fn check_events(stack: &Stack) -> Result<BTreeSet<String>> {
    check_all(stack.stored_events().await?)
}

/// Checks events; appends their kinds to `target/test-artifacts/event-kinds-seen.txt`, the
/// suite's record of what it observed (delete it before a run to see one run's).
fn check_all(events: Vec<(String, Vec<u8>)>) -> Result<BTreeSet<String>> {
    let mut kinds = BTreeSet::new();
    for (subject, payload) in events {
        kinds.insert(check_event(&subject, &payload)?);
    }
    if let Ok(path) = turnstile_tests::artifact("event-kinds-seen.txt") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let lines: String = kinds.iter().map(|k| format!("{k}\n")).collect();
            let _ = f.write_all(lines.as_bytes());
        }
    }
    Ok(kinds)
}

/// For `stack::report`: the stack's events against the document, when the test ran on a
/// multi-threaded runtime and its NATS server still answers (a test may have stopped it).
pub fn check_stack(stack: &Stack) -> Result<()> {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return Ok(());
    };
    if handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
        return Ok(());
    }
    let stored = tokio::task::block_in_place(|| {
        handle.block_on(async {
            tokio::time::timeout(Duration::from_secs(20), stack.stored_events()).await
        })
    });
    let stored = match stored {
        Ok(Ok(stored)) => stored,
        Ok(Err(e)) => {
            eprintln!("asyncapi: this test's events could not be read ({e:#}); not checked");
            return Ok(());
        }
        Err(_) => {
            eprintln!("asyncapi: this test's events took over 20 s to read; not checked");
            return Ok(());
        }
    };
    check_all(stored).map(|_| ())
}

#[test]
fn the_asyncapi_document_is_valid_and_names_every_event_kind() -> Result<()> {
    use roas_asyncapi::validation::{Validate, ValidationOptions};
    let doc = document()?;
    ensure!(doc["asyncapi"] == "3.0.0", "asyncapi: {}", doc["asyncapi"]);
    let typed: roas_asyncapi::v3_0::Document =
        serde_json::from_value(doc.clone()).context("not an AsyncAPI 3.0 document")?;
    if let Err(e) = typed.validate(enumset::EnumSet::only(
        ValidationOptions::ErrorOnExternalReference,
    )) {
        bail!("docs/asyncapi.yaml is not valid AsyncAPI 3.0: {e}");
    }
    let spec = spec()?;
    let named: BTreeSet<&str> = spec.messages.values().map(|(n, _)| n.as_str()).collect();
    for kind in EventKind::all() {
        ensure!(named.contains(kind.as_str()), "no message for {kind}");
    }
    ensure!(
        named.len() == EventKind::all().count(),
        "messages for kinds the registry does not have: {named:?}"
    );
    // Each operation receives on a channel of the document, its message that channel's.
    for (id, op) in doc["operations"].as_object().context("no operations")? {
        ensure!(
            op["action"] == "receive",
            "operation {id}: {}",
            op["action"]
        );
        let channel = pointer(&doc, op["channel"]["$ref"].as_str().unwrap_or_default())
            .with_context(|| format!("operation {id}"))?;
        for m in op["messages"].as_array().context("no messages")? {
            let target = pointer(&doc, m["$ref"].as_str().unwrap_or_default())
                .with_context(|| format!("operation {id}"))?;
            ensure!(
                channel["messages"]
                    .as_object()
                    .is_some_and(|ms| ms.values().any(|v| v == target)),
                "operation {id} receives a message its channel does not carry"
            );
        }
    }
    // The examples are real shapes: each validates, and goes to a channel of its type.
    for (key, message) in doc["components"]["messages"]
        .as_object()
        .context("messages")?
    {
        let (name, validator) = &spec.messages[key];
        let examples = message["examples"].as_array().context("no examples")?;
        ensure!(!examples.is_empty(), "message {key} has no example");
        for ex in examples {
            let payload = &ex["payload"];
            let errors: Vec<String> = validator
                .iter_errors(payload)
                .map(|e| e.to_string())
                .collect();
            ensure!(errors.is_empty(), "example of {key}: {errors:?}");
            ensure!(
                payload["type"] == name.as_str(),
                "example of {key} is a {}",
                payload["type"]
            );
        }
    }
    // A payload that breaks the envelope is refused: the schemas are not empty.
    let bad = serde_json::json!({"v": 2, "id": "x", "type": "turn.completed", "at": "now"});
    let (_, turn_completed) = spec
        .messages
        .values()
        .find(|(n, _)| n == "turn.completed")
        .context("turn.completed")?;
    ensure!(
        !turn_completed.is_valid(&bad),
        "an envelope of version 2 passed"
    );
    Ok(())
}

#[test]
fn subjects_find_their_channel() -> Result<()> {
    let s = turnstile_shared::SessionId::new();
    let event = |kind: &str| {
        serde_json::json!({"v": 1, "id": "i", "type": kind, "at": "2026-03-02T10:15:04.118Z",
            "session": s.to_string()})
        .to_string()
    };
    // A session event on a host's subject has no channel.
    let wrong = check_event(
        &subjects::host_event("h1", EventKind::SessionStopped.as_str()),
        event("session.stopped").as_bytes(),
    );
    ensure!(wrong.is_err(), "a session event passed on a host subject");
    // The right subject with the wrong type in the payload is refused too.
    let mismatch = check_event(
        &subjects::session_event(s.as_str(), "session.stopped"),
        event("session.created").as_bytes(),
    );
    ensure!(
        mismatch.is_err(),
        "a session.created payload passed as session.stopped"
    );
    Ok(())
}
