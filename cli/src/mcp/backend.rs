//! The seam between the MCP tools and the broker's request/reply API: a trait, so the tool
//! logic is unit-tested against a fake, and its NATS implementation, which connects lazily.

use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::Value;
use tokio::sync::OnceCell;
use turnstile_shared::step_api::Caller;

const API_TIMEOUT: Duration = Duration::from_secs(10);

/// The broker's request/reply API: one request on `subject`, its reply or an error text.
pub trait Backend: Send + Sync + 'static {
    fn call(&self, subject: String, request: Value) -> BoxFuture<'_, Result<Value, String>>;
}

/// Connects on the first tool call (and again after a failed attempt), so the server answers
/// `initialize` at once even when NATS is down.
pub struct Nats {
    url: String,
    /// Who the tools act for: the connection is made as this principal (its own NATS
    /// identity where the deployment issues them).
    caller: Option<Caller>,
    client: OnceCell<async_nats::Client>,
}

impl Nats {
    pub fn new(url: &str, caller: Option<Caller>) -> Self {
        Self {
            url: url.to_string(),
            caller,
            client: OnceCell::new(),
        }
    }
}

impl Backend for Nats {
    fn call(&self, subject: String, request: Value) -> BoxFuture<'_, Result<Value, String>> {
        Box::pin(async move {
            let client = self
                .client
                .get_or_try_init(|| {
                    turnstile_shared::principal::connect(
                        &self.url,
                        "turnstile-mcp",
                        self.caller.as_ref(),
                    )
                })
                .await
                .map_err(|e| {
                    format!("{e} (is Turnstile running? set --nats or TURNSTILE_NATS_URL)")
                })?;
            turnstile_shared::api::call::<Value, Value>(client, &subject, &request, API_TIMEOUT)
                .await
                .map_err(|e| e.to_string())
        })
    }
}

/// A fake broker API for the tests of the tools and of the server.
#[cfg(test)]
pub mod fake {
    use std::sync::{Arc, Mutex};

    use serde_json::json;
    use turnstile_shared::{SessionId, StepId};

    use super::*;

    /// Records each call and answers with `reply` (or an error when it is `None`).
    #[derive(Default)]
    pub struct Fake {
        pub calls: Mutex<Vec<(String, Value)>>,
        pub reply: Option<Value>,
    }

    impl Backend for Arc<Fake> {
        fn call(&self, subject: String, req: Value) -> BoxFuture<'_, Result<Value, String>> {
            self.calls.lock().unwrap().push((subject, req));
            let reply = self.reply.clone().ok_or("unavailable: no NATS".to_string());
            Box::pin(async move { reply })
        }
    }

    /// A fake answering `reply`: one handle to inspect, one to hand to the code under test.
    pub fn fake(reply: Option<Value>) -> (Arc<Fake>, Arc<Fake>) {
        let fake = Arc::new(Fake {
            calls: Mutex::default(),
            reply,
        });
        (fake.clone(), fake)
    }

    /// Session credentials, as an agent's terminal has them.
    pub fn caller() -> Caller {
        Caller {
            session: Some(SessionId::new()),
            step: None,
            token: "tok".into(),
        }
    }

    /// A step's record as the broker returns it (with the token the tools must not show).
    pub fn record(id: &StepId) -> Value {
        json!({
            "id": id.to_string(), "kind": "step", "name": "build", "scope": "run",
            "session": SessionId::new().to_string(), "created_at": "2025-01-01T00:00:00Z",
            "token": "secret-token", "status": "queued"
        })
    }
}
