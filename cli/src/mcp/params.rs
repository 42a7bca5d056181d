//! The MCP tools' parameters as typed structs. rmcp derives each tool's JSON input schema from
//! them (through schemars: the doc comments become the field descriptions an agent reads,
//! `deny_unknown_fields` becomes `additionalProperties: false`), and deserializes a call's
//! arguments into them before the tool runs.

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use turnstile_shared::execution::Scope;

/// Arguments of `start_step`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StartStepParams {
    /// A short label for the step, shown with its result.
    pub name: String,
    /// argv, no shell (use ["sh", "-c", "..."] for one). Required for kind command.
    #[schemars(length(min = 1))]
    pub command: Option<Vec<String>>,
    /// session (default): outlives this turn, and ends when it finishes, your run fails or
    /// your session stops; its result comes back to this conversation. turn: cancelled as soon
    /// as this turn ends (only for work that is part of the turn itself). detached:
    /// independent of this session, which is still told of its end.
    #[serde(default, deserialize_with = "null_is_default")]
    pub scope: ScopeParam,
    /// command: run `command` on this session's host; external: for a worker serving `queue`.
    #[serde(default, deserialize_with = "null_is_default")]
    pub kind: KindParam,
    /// The worker queue. Required for kind external.
    pub queue: Option<String>,
    /// Any JSON input for an external step.
    pub input: Option<Value>,
}

/// Arguments of `start_agent`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StartAgentParams {
    /// A short label for the agent.
    pub name: String,
    /// What the agent should do.
    pub prompt: String,
    /// session (default): outlives this turn, and ends when it finishes, your run fails or
    /// your session stops; its result comes back to this conversation. turn: cancelled as soon
    /// as this turn ends (only for work that is part of the turn itself). detached:
    /// independent of this session, which is still told of its end.
    #[serde(default, deserialize_with = "null_is_default")]
    pub scope: ScopeParam,
}

/// Arguments of `step_status`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepStatusParams {
    /// The step id (stp_...), as start_step or list_steps gave it.
    pub id: String,
}

/// `list_steps` takes no arguments (its schema still lists the empty `properties`, which some
/// clients require).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(extend("properties" = {}))]
pub struct ListStepsParams {}

/// Who may end a step besides itself (R7).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(inline)]
pub enum ScopeParam {
    #[default]
    #[serde(alias = "run")]
    Session,
    Turn,
    Detached,
}

impl From<ScopeParam> for Scope {
    fn from(s: ScopeParam) -> Self {
        match s {
            ScopeParam::Session => Scope::Session,
            ScopeParam::Turn => Scope::Turn,
            ScopeParam::Detached => Scope::Detached,
        }
    }
}

/// What a step runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(inline)]
pub enum KindParam {
    #[default]
    Command,
    External,
}

/// A missing field and an explicit `null` both mean the default, as before the typed params.
fn null_is_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}
