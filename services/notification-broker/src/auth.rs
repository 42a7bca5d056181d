//! Who a step API call acts for. A session presents its token, a step its own; anything else
//! is refused with a clear error and recorded as an `auth.refused` event (R8, R15).

use serde_json::json;
use turnstile_shared::api::{ApiError, ErrorCode};
use turnstile_shared::events::{self, EventKind};
use turnstile_shared::execution::ExecutionRecord;
use turnstile_shared::principal::Principal;
use turnstile_shared::records::SessionRecord;
use turnstile_shared::step_api::Caller;
use turnstile_shared::Envelope;

use crate::ctx::Ctx;

pub(crate) enum Identity {
    Session(Box<SessionRecord>),
    Step(Box<ExecutionRecord>),
}

/// Compares secrets without an early exit, so timing does not reveal a token's prefix.
pub(crate) fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Who a call acts for: the request's credentials, which must belong to the principal of the
/// subject it came on (an agent's NATS identity may publish only on its own).
pub(crate) async fn authenticate(
    ctx: &Ctx,
    principal: &Principal,
    caller: &Caller,
    action: &str,
) -> Result<Identity, ApiError> {
    if !principal.admits(caller) {
        let why = format!(
            "credentials of {} on {principal}'s subject",
            Principal::of(caller)
        );
        return Err(refuse(ctx, caller, action, &why).await);
    }
    if caller.token.is_empty() {
        return Err(refuse(ctx, caller, action, "no token presented").await);
    }
    match (&caller.session, &caller.step) {
        (_, Some(step)) => {
            let record = ctx
                .buckets
                .executions
                .get::<ExecutionRecord>(step.as_str())
                .await
                .map_err(ApiError::from)?;
            match record {
                Some((r, _))
                    if r.token
                        .as_deref()
                        .is_some_and(|t| same_secret(t, &caller.token)) =>
                {
                    Ok(Identity::Step(Box::new(r)))
                }
                Some(_) => Err(refuse(ctx, caller, action, "wrong token for this step").await),
                None => Err(refuse(ctx, caller, action, "no such step").await),
            }
        }
        (Some(session), None) => {
            let record = ctx
                .buckets
                .sessions
                .get::<SessionRecord>(session.as_str())
                .await
                .map_err(ApiError::from)?;
            match record {
                Some((r, _)) if same_secret(&r.token, &caller.token) => {
                    if r.is_active() {
                        Ok(Identity::Session(Box::new(r)))
                    } else {
                        Err(ApiError::new(
                            ErrorCode::SessionStopped,
                            format!("session {session} is stopped"),
                        ))
                    }
                }
                Some(_) => Err(refuse(ctx, caller, action, "wrong token for this session").await),
                None => Err(refuse(ctx, caller, action, "no such session").await),
            }
        }
        (None, None) => Err(refuse(ctx, caller, action, "no session or step named").await),
    }
}

/// Records the refusal and builds the caller's error. The token itself is never recorded.
async fn refuse(ctx: &Ctx, caller: &Caller, action: &str, why: &str) -> ApiError {
    turnstile_shared::metrics::metrics()
        .auth_refusals
        .get_or_create(&turnstile_shared::metrics::ApiLabel { api: "steps" })
        .inc();
    let data = json!({
        "action": action,
        "reason": why,
        "session": caller.session,
        "step": caller.step,
    });
    let event =
        Envelope::new(EventKind::AuthRefused.as_str(), &data).map(|e| match &caller.session {
            Some(s) => e.with_session(s),
            None => e,
        });
    match event {
        Ok(ev) => {
            if let Err(e) = events::publish(&ctx.js, &ev).await {
                tracing::warn!(error = %e, "record auth.refused");
            }
        }
        Err(e) => tracing::warn!(error = %e, "build auth.refused"),
    }
    tracing::warn!(action, reason = why, session = ?caller.session, step = ?caller.step, "call refused");
    ApiError::new(ErrorCode::Unauthorized, format!("{action} refused: {why}"))
}

#[cfg(test)]
mod tests {
    use super::same_secret;

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd"));
        assert!(!same_secret("abc", "ab"));
        assert!(!same_secret("", "a"));
    }
}
