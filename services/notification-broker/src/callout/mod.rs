//! Agent identities through the NATS server's auth callout. An agent (or a step's process)
//! connects with its principal as user and its token as password; the server asks us
//! (`$SYS.REQ.USER.AUTH`, a queue group across broker replicas), we check the token as the
//! step API does, and answer with a user JWT, signed by the account key the server trusts,
//! that may only send requests on the principal's own step and exec subjects and read their
//! replies. A stopped session or an ended step is refused at once; a stopped session's live
//! connections are ended by [`revoke`], and every credential expires after its TTL anyway.

mod claims;
mod error;
mod revoke;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use turnstile_shared::principal::Principal;
use turnstile_shared::step_api::Caller;
use turnstile_shared::subjects::api as subj;

use crate::auth::{authenticate, Identity};
use crate::ctx::Ctx;
pub use error::CalloutError;

/// How the broker answers auth callouts.
#[derive(Clone)]
pub struct CalloutConfig {
    /// The account key (seed `SA…`) whose public key is the callout `issuer` in the server's
    /// config; it signs every credential issued.
    pub issuer_seed: String,
    /// The account the issued identities are placed in (the one the services use).
    pub account: String,
    /// How long an issued credential lives before the client must authenticate again.
    pub ttl: Duration,
    /// A system-account identity that may list connections and end them: with it, a stopped
    /// session's live connections end within a second or so; without, at their TTL.
    pub system_url: Option<String>,
}

impl std::fmt::Debug for CalloutConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CalloutConfig")
            .field("account", &self.account)
            .field("ttl", &self.ttl)
            .field("system_url", &self.system_url.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// The signing key from an account seed (`SA…`): the one check of it, for the broker and
/// `turnstile admin issuer`.
pub fn account_key(seed: &str) -> Result<nkeys::KeyPair, String> {
    let seed = seed.trim();
    if !seed.starts_with("SA") {
        return Err("not an account seed (it must start with SA)".into());
    }
    nkeys::KeyPair::from_seed(seed).map_err(|e| e.to_string())
}

/// Answers auth callouts until `shutdown`, and ends stopped sessions' connections.
pub(crate) async fn run(
    ctx: Arc<Ctx>,
    config: CalloutConfig,
    shutdown: CancellationToken,
) -> Result<(), CalloutError> {
    let issuer = Arc::new(account_key(&config.issuer_seed).map_err(CalloutError::Seed)?);
    let mut requests = ctx
        .client
        .queue_subscribe(subj::AUTH_CALLOUT, subj::AUTH_CALLOUT_GROUP.to_string())
        .await
        .map_err(|source| CalloutError::Subscribe {
            subject: subj::AUTH_CALLOUT,
            source,
        })?;
    let revoker = revoke::Revoker::start(&ctx, config.system_url.as_deref(), &shutdown).await?;
    tracing::info!(
        issuer = %issuer.public_key(),
        account = %config.account,
        revokes_live_connections = revoker.is_some(),
        "answering auth callouts"
    );
    let config = Arc::new(config);
    loop {
        let msg = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            m = requests.next() => match m { Some(m) => m, None => break },
        };
        let (ctx, issuer, config) = (ctx.clone(), issuer.clone(), config.clone());
        tokio::spawn(async move { answer(&ctx, &issuer, &config, msg).await });
    }
    if let Some(r) = revoker {
        r.stop().await;
    }
    Ok(())
}

/// One callout: read the request, decide, reply with the signed response.
async fn answer(
    ctx: &Ctx,
    issuer: &nkeys::KeyPair,
    config: &CalloutConfig,
    msg: async_nats::Message,
) {
    let Some(reply) = msg.reply.clone() else {
        return;
    };
    let req = match std::str::from_utf8(&msg.payload)
        .map_err(|e| claims::ClaimsError::Request(e.to_string()))
        .and_then(claims::read_request)
    {
        Ok(r) => r,
        Err(e) => {
            // Without a readable request there is no key to answer for; the server times out.
            tracing::error!(error = %e, "auth callout request refused");
            return;
        }
    };
    let user = req.connect_opts.user.clone();
    let signed = match decide(ctx, &user, &req.connect_opts.pass).await {
        Ok(principal) => {
            tracing::debug!(%principal, cid = req.client_info.id, "agent identity issued");
            claims::admit(issuer, &req, &principal, &config.account, config.ttl)
        }
        Err(why) => {
            tracing::warn!(user = %user, host = %req.client_info.host, reason = %why, "agent connection refused");
            turnstile_shared::metrics::metrics()
                .auth_refusals
                .get_or_create(&turnstile_shared::metrics::ApiLabel { api: "callout" })
                .inc();
            claims::refuse(issuer, &req, &why)
        }
    };
    match signed {
        Ok(token) => {
            if let Err(e) = ctx.client.publish(reply, token.into()).await {
                tracing::warn!(error = %e, "answer auth callout");
            }
        }
        Err(e) => tracing::error!(error = %e, "auth callout"),
    }
}

/// Who may connect: a running session with its token, or a step that has not ended with its
/// own. Everything else (operators, services, unknown names) has identities of its own in
/// the server's config and never reaches the callout.
async fn decide(ctx: &Ctx, user: &str, password: &str) -> Result<Principal, String> {
    let principal: Principal = user
        .parse()
        .map_err(|e| format!("{user:?} is not an agent identity: {e}"))?;
    let caller = match &principal {
        Principal::Session(s) => Caller {
            session: Some(s.clone()),
            step: None,
            token: password.to_string(),
        },
        Principal::Step(s) => Caller {
            session: None,
            step: Some(s.clone()),
            token: password.to_string(),
        },
        Principal::Operator => return Err("the operator principal is not an agent identity".into()),
    };
    match authenticate(ctx, &principal, &caller, "connect").await {
        Ok(Identity::Step(step)) if step.status.is_terminal() => {
            Err(format!("step {} has ended", step.id))
        }
        Ok(_) => Ok(principal),
        Err(e) => Err(e.message),
    }
}
