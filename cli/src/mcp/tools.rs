//! What each MCP tool does, apart from the protocol: the broker request it builds from its
//! typed parameters (`params.rs`) and the text it answers with. rmcp's wiring lives in
//! `mod.rs` and NATS behind [`Backend`], so every tool is unit-tested against a fake.

use serde::Serialize;
use serde_json::Value;
use turnstile_shared::execution::ExecutionRecord;
use turnstile_shared::principal::Principal;
use turnstile_shared::step_api::{Caller, ListSteps, StartStep, StepKind, StepStatus};
use turnstile_shared::subjects::api as subj;
use turnstile_shared::StepId;

use super::backend::Backend;
use super::params::{
    KindParam, ListStepsParams, StartAgentParams, StartStepParams, StepStatusParams,
};

pub const NO_CREDENTIALS: &str = "turnstile mcp has no credentials: its environment needs \
    TURNSTILE_SESSION and TURNSTILE_TOKEN (set in a Turnstile agent's terminal), or \
    TURNSTILE_STEP and TURNSTILE_STEP_TOKEN (set in a step's process). Launch the MCP server \
    from that environment or pass them in its MCP config.";

/// The tools' logic: the caller's credentials and the broker API behind a [`Backend`].
pub struct Tools<B> {
    caller: Option<Caller>,
    backend: B,
}

impl<B: Backend> Tools<B> {
    pub fn new(caller: Option<Caller>, backend: B) -> Self {
        Self { caller, backend }
    }

    /// Failures read `TOOL: why`, as the tool result's text (with `isError`).
    pub async fn start_step(&self, p: StartStepParams) -> Result<String, String> {
        let run = async {
            let req = start_request(self.caller()?, p)?;
            let rec: ExecutionRecord = self.api(subj::START, &req).await?;
            Ok(format!(
                "started step {} ({}, scope {}); its result is delivered to this \
                 conversation when it ends\n{}",
                rec.id,
                rec.name,
                rec.scope,
                pretty(&rec.redacted())
            ))
        };
        run.await.map_err(|e: String| format!("start_step: {e}"))
    }

    pub async fn start_agent(&self, p: StartAgentParams) -> Result<String, String> {
        let run = async {
            let caller = self.caller()?;
            let name = non_empty("name", p.name)?;
            let prompt = non_empty("prompt", p.prompt)?;
            let req = StartStep {
                caller,
                name,
                scope: p.scope.into(),
                work: StepKind::Agent { prompt },
                id: Some(StepId::new()),
            };
            let rec: ExecutionRecord = self.api(subj::START, &req).await?;
            Ok(format!(
                "started background agent {} ({}); its final reply is delivered to this \
                 conversation once everything it started is done\n{}",
                rec.id,
                rec.name,
                pretty(&rec.redacted())
            ))
        };
        run.await.map_err(|e: String| format!("start_agent: {e}"))
    }

    pub async fn step_status(&self, p: StepStatusParams) -> Result<String, String> {
        let run = async {
            let caller = self.caller()?;
            let step: StepId = p.id.parse().map_err(|e| format!("bad `id`: {e}"))?;
            let rec: ExecutionRecord = self.api(subj::STATUS, &StepStatus { caller, step }).await?;
            Ok(format!("{}\n{}", summary(&rec), pretty(&rec.redacted())))
        };
        run.await.map_err(|e: String| format!("step_status: {e}"))
    }

    pub async fn list_steps(&self, _: ListStepsParams) -> Result<String, String> {
        let run = async {
            let caller = self.caller()?;
            let req = ListSteps {
                caller,
                page: Default::default(),
            };
            let page: turnstile_shared::page::Page<ExecutionRecord> =
                self.api(subj::LIST, &req).await?;
            let recs: Vec<ExecutionRecord> =
                page.items.iter().map(ExecutionRecord::redacted).collect();
            let mut text: String = recs.iter().map(|r| summary(r) + "\n").collect();
            if recs.is_empty() {
                text.push_str("no steps\n");
            }
            Ok(text + &pretty(&recs))
        };
        run.await.map_err(|e: String| format!("list_steps: {e}"))
    }

    fn caller(&self) -> Result<Caller, String> {
        self.caller
            .clone()
            .ok_or_else(|| NO_CREDENTIALS.to_string())
    }

    /// One request on the caller's own `ts.api.steps.<principal>.<verb>`.
    async fn api<Req: Serialize, Resp: serde::de::DeserializeOwned>(
        &self,
        verb: &'static str,
        req: &Req,
    ) -> Result<Resp, String> {
        let subject = Principal::of(&self.caller()?).steps(verb);
        let body = serde_json::to_value(req).map_err(|e| format!("encode request: {e}"))?;
        let reply = self.backend.call(subject.clone(), body).await?;
        serde_json::from_value(reply).map_err(|e| format!("unreadable reply on {subject}: {e}"))
    }
}

fn start_request(caller: Caller, p: StartStepParams) -> Result<StartStep, String> {
    let name = non_empty("name", p.name)?;
    let input = p.input.unwrap_or(Value::Null);
    let work = match p.kind {
        KindParam::Command => {
            if p.queue.is_some() || !input.is_null() {
                return Err("`queue` and `input` are only for kind \"external\"".into());
            }
            match p.command {
                Some(argv) if !argv.is_empty() => StepKind::Command { argv },
                _ => {
                    return Err("`command` is required for a command step (a non-empty \
                                array of strings)"
                        .into())
                }
            }
        }
        KindParam::External => {
            if p.command.is_some() {
                return Err("`command` is only for kind \"command\"".into());
            }
            let queue = p
                .queue
                .filter(|q| !q.is_empty())
                .ok_or("`queue` is required for an external step")?;
            StepKind::External { queue, input }
        }
    };
    Ok(StartStep {
        caller,
        name,
        scope: p.scope.into(),
        work,
        id: Some(StepId::new()),
    })
}

fn non_empty(key: &str, value: String) -> Result<String, String> {
    if value.trim().is_empty() {
        return Err(format!("`{key}` is required (a non-empty string)"));
    }
    Ok(value)
}

fn summary(r: &ExecutionRecord) -> String {
    format!(
        "{} {} [{}] {}: {}",
        r.id,
        r.status.name(),
        r.scope,
        r.name,
        r.status.summary()
    )
}

fn pretty<T: Serialize>(v: &T) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("(unprintable: {e})"))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use super::*;
    use crate::mcp::backend::fake::{caller, fake, record, Fake};

    fn tools(caller: Option<Caller>, reply: Option<Value>) -> (Tools<Arc<Fake>>, Arc<Fake>) {
        let (fake, backend) = fake(reply);
        (Tools::new(caller, backend), fake)
    }

    /// Calls `tool` with `args` as rmcp would: deserialize the params, then run the tool.
    async fn call(t: &Tools<Arc<Fake>>, tool: &str, args: Value) -> Result<String, String> {
        fn parse<P: serde::de::DeserializeOwned>(args: Value) -> Result<P, String> {
            serde_json::from_value(args).map_err(|e| format!("bad arguments: {e}"))
        }
        match tool {
            "start_step" => t.start_step(parse(args)?).await,
            "start_agent" => t.start_agent(parse(args)?).await,
            "step_status" => t.step_status(parse(args)?).await,
            "list_steps" => t.list_steps(parse(args)?).await,
            other => panic!("no tool {other}"),
        }
    }

    #[tokio::test]
    async fn tool_calls_without_credentials_explain_the_env() {
        let (t, fake) = tools(None, None);
        let text = call(&t, "list_steps", json!({})).await.unwrap_err();
        assert!(text.starts_with("list_steps: "), "{text}");
        assert!(text.contains("TURNSTILE_SESSION") && text.contains("TURNSTILE_STEP_TOKEN"));
        assert!(fake.calls.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn bad_arguments_are_tool_errors() {
        let (t, fake) = tools(Some(caller()), None);
        for (tool, args, needle) in [
            (
                "start_step",
                json!({"command": ["ls"]}),
                "missing field `name`",
            ),
            (
                "start_step",
                json!({"name": " ", "command": ["ls"]}),
                "`name` is required",
            ),
            ("start_step", json!({"name": "x"}), "`command` is required"),
            (
                "start_step",
                json!({"name": "x", "command": []}),
                "`command` is required",
            ),
            (
                "start_step",
                json!({"name": "x", "command": "ls -l"}),
                "expected a sequence",
            ),
            (
                "start_step",
                json!({"name": "x", "command": ["ls", 1]}),
                "expected a string",
            ),
            (
                "start_step",
                json!({"name": "x", "command": ["ls"], "scope": "forever"}),
                "unknown variant `forever`",
            ),
            (
                "start_step",
                json!({"name": "x", "kind": "external"}),
                "`queue` is required",
            ),
            (
                "start_step",
                json!({"name": "x", "command": ["ls"], "queue": "q"}),
                "only for kind \"external\"",
            ),
            (
                "start_step",
                json!({"name": "x", "kind": "external", "queue": "q", "command": ["ls"]}),
                "only for kind \"command\"",
            ),
            (
                "start_step",
                json!({"name": "x", "kind": "lambda"}),
                "unknown variant `lambda`",
            ),
            (
                "start_step",
                json!({"name": "x", "cmd": ["ls"]}),
                "unknown field `cmd`",
            ),
            (
                "start_agent",
                json!({"name": "x", "prompt": ""}),
                "`prompt` is required",
            ),
            ("step_status", json!({}), "missing field `id`"),
            ("step_status", json!({"id": 5}), "expected a string"),
            ("step_status", json!({"id": "trn_abc"}), "bad `id`"),
            ("list_steps", json!({"all": true}), "unknown field `all`"),
        ] {
            let text = call(&t, tool, args.clone()).await.unwrap_err();
            assert!(text.contains(needle), "{tool} {args}: {text}");
        }
        assert!(fake.calls.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn start_step_sends_the_request_and_reports_the_record() {
        let id = StepId::new();
        let (t, fake) = tools(Some(caller()), Some(record(&id)));
        let args = json!({"name": "build", "command": ["cargo", "build"], "scope": "run"});
        let text = call(&t, "start_step", args).await.unwrap();
        // `run`, an older client's spelling, is read as `session`.
        assert!(text.starts_with(&format!("started step {id} (build, scope session)")));
        assert!(text.contains("delivered to this conversation when it ends"));
        assert!(!text.contains("secret-token"));
        let calls = fake.calls.lock().unwrap();
        let (subject, req) = &calls[0];
        let session = req["caller"]["session"].as_str().unwrap();
        assert_eq!(subject, &format!("ts.api.steps.{session}.start"));
        assert_eq!(
            req["work"],
            json!({"kind": "command", "argv": ["cargo", "build"]})
        );
        assert_eq!(req["scope"], "session");
        assert_eq!(req["name"], "build");
        assert!(req["id"].as_str().is_some_and(|i| i.starts_with("stp_")));
        assert_eq!(req["caller"]["token"], "tok");
    }

    #[tokio::test]
    async fn external_steps_and_agents_build_their_requests() {
        let id = StepId::new();
        let (t, fake) = tools(Some(caller()), Some(record(&id)));
        let args = json!({"name": "review", "kind": "external", "queue": "review",
            "input": {"pr": 7}, "scope": null});
        call(&t, "start_step", args).await.unwrap();
        let args = json!({"name": "helper", "prompt": "fix the build", "scope": "detached"});
        let text = call(&t, "start_agent", args).await.unwrap();
        assert!(text.starts_with(&format!("started background agent {id}")));
        let calls = fake.calls.lock().unwrap();
        assert_eq!(
            calls[0].1["work"],
            json!({"kind": "external", "queue": "review", "input": {"pr": 7}})
        );
        // No scope given: the step outlives the turn (its result comes back later).
        assert_eq!(calls[0].1["scope"], "session");
        assert!(calls[1].0.ends_with(".start"), "{}", calls[1].0);
        assert_eq!(
            calls[1].1["work"],
            json!({"kind": "agent", "prompt": "fix the build"})
        );
        assert_eq!(calls[1].1["scope"], "detached");
    }

    #[tokio::test]
    async fn status_list_and_api_failures() {
        let id = StepId::new();
        let (t, fake) = tools(Some(caller()), Some(record(&id)));
        let text = call(&t, "step_status", json!({"id": id.to_string()}))
            .await
            .unwrap();
        assert!(text.starts_with(&format!("{id} queued")));
        assert!(fake.calls.lock().unwrap()[0].0.ends_with(".status"));
        assert_eq!(fake.calls.lock().unwrap()[0].1["step"], id.to_string());

        let (t, fake) = tools(Some(caller()), Some(json!({"items": [record(&id)]})));
        let text = call(&t, "list_steps", json!({})).await.unwrap();
        assert!(text.starts_with(&format!("{id} queued [session] build")));
        assert!(!text.contains("secret-token"));
        assert!(fake.calls.lock().unwrap()[0].0.ends_with(".list"));

        let (t, _) = tools(Some(caller()), Some(json!({"items": []})));
        let text = call(&t, "list_steps", json!({})).await.unwrap();
        assert!(text.starts_with("no steps\n"), "{text}");

        let (t, _) = tools(Some(caller()), None);
        let text = call(&t, "list_steps", json!({})).await.unwrap_err();
        assert_eq!(text, "list_steps: unavailable: no NATS");

        let (t, _) = tools(Some(caller()), Some(json!({"not": "a record"})));
        let text = call(&t, "step_status", json!({"id": id.to_string()}))
            .await
            .unwrap_err();
        assert!(text.contains("unreadable reply"), "{text}");
    }
}
