//! The JWTs of the auth callout protocol (nats-server 2.10+): the server's signed
//! authorization request, and our signed response carrying a user JWT limited to one
//! principal's subjects. Signing and verification are nkeys'; the claims' layout is
//! nats-jwt-rs's. Only the request's reading is ours, so that fields a newer server adds or
//! leaves out never make a valid request unreadable.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nats_jwt_rs::authorization::AuthResponse;
use nats_jwt_rs::user::User;
use nats_jwt_rs::{Claim, Claims};
use serde::Deserialize;
use turnstile_shared::principal::Principal;
use turnstile_shared::subjects::api as subj;

#[derive(Debug, thiserror::Error)]
pub enum ClaimsError {
    #[error("unreadable authorization request: {0}")]
    Request(String),
    #[error("sign the authorization response: {0}")]
    Sign(String),
}

/// What the server tells us of a connecting client (the parts we use).
#[derive(Debug, Clone, Default, serde::Serialize, Deserialize)]
#[serde(default)]
pub struct AuthRequest {
    pub server_id: ServerId,
    /// The key the server made for this connection; the user JWT must be issued to it.
    pub user_nkey: String,
    pub client_info: ClientInfo,
    pub connect_opts: ConnectOpts,
}

impl Claim for AuthRequest {
    fn validate() {}
}

#[derive(Debug, Clone, Default, serde::Serialize, Deserialize)]
#[serde(default)]
pub struct ServerId {
    pub id: String,
    pub name: String,
}

#[derive(Debug, Clone, Default, serde::Serialize, Deserialize)]
#[serde(default)]
pub struct ClientInfo {
    pub host: String,
    /// The connection's id on its server (what a kick names).
    pub id: u64,
}

#[derive(Clone, Default, serde::Serialize, Deserialize)]
#[serde(default)]
pub struct ConnectOpts {
    pub user: String,
    pub pass: String,
}

impl std::fmt::Debug for ConnectOpts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectOpts")
            .field("user", &self.user)
            .field("pass", &"<redacted>")
            .finish()
    }
}

/// Reads a request and checks its signature (by the key it names as issuer, the server's).
pub fn read_request(token: &str) -> Result<AuthRequest, ClaimsError> {
    Claims::<AuthRequest>::decode(token)
        .map(|c| c.nats)
        .map_err(|e| ClaimsError::Request(e.to_string()))
}

/// The response admitting the connection as `principal`, placed in `account`, for `ttl`: it
/// may publish requests on the principal's own step and exec subjects and receive their
/// replies, nothing else.
pub fn admit(
    issuer: &nkeys::KeyPair,
    req: &AuthRequest,
    principal: &Principal,
    account: &str,
    ttl: Duration,
) -> Result<String, ClaimsError> {
    let name = principal.to_string();
    let mut user = User::new_claims(name.clone(), req.user_nkey.clone());
    user.aud = Some(account.to_string());
    user.exp = Some(unix_now().saturating_add(ttl.as_secs().max(1)) as i64);
    let perms = &mut user.nats.permissions.permissions;
    perms.publish.allow = subj::agent_publish(&name);
    perms.subscribe.allow = subj::agent_subscribe(&name);
    let jwt = user
        .encode(issuer)
        .map_err(|e| ClaimsError::Sign(e.to_string()))?;
    respond(issuer, req, jwt, String::new())
}

/// The response refusing the connection, with the reason the server logs.
pub fn refuse(
    issuer: &nkeys::KeyPair,
    req: &AuthRequest,
    why: &str,
) -> Result<String, ClaimsError> {
    respond(issuer, req, String::new(), why.to_string())
}

fn respond(
    issuer: &nkeys::KeyPair,
    req: &AuthRequest,
    jwt: String,
    error: String,
) -> Result<String, ClaimsError> {
    let mut resp = AuthResponse::generic_claim(req.user_nkey.clone());
    resp.aud = Some(req.server_id.id.clone());
    resp.nats.jwt = jwt;
    resp.nats.error = error;
    resp.encode(issuer)
        .map_err(|e| ClaimsError::Sign(e.to_string()))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnstile_shared::SessionId;

    fn request(server: &nkeys::KeyPair) -> (AuthRequest, String) {
        let user = nkeys::KeyPair::new_user();
        let req = AuthRequest {
            server_id: ServerId {
                id: server.public_key(),
                name: "n".into(),
            },
            user_nkey: user.public_key(),
            client_info: ClientInfo {
                host: "127.0.0.1".into(),
                id: 7,
            },
            connect_opts: ConnectOpts {
                user: "ses_x".into(),
                pass: "secret".into(),
            },
        };
        // A request as the server signs it: the claims under `nats`, issued by its key.
        let value = serde_json::to_value(&req).expect("json");
        let token = encode_raw(server, value);
        (req, token)
    }

    /// Any claims, as JSON: what the server reads of our JWTs.
    #[derive(Clone, serde::Serialize, serde::Deserialize)]
    struct Raw(serde_json::Value);
    impl Claim for Raw {
        fn validate() {}
    }

    fn decode(token: &str) -> Claims<Raw> {
        Claims::<Raw>::decode(token).expect("a signed JWT")
    }

    fn encode_raw(key: &nkeys::KeyPair, nats: serde_json::Value) -> String {
        let claims: Claims<Raw> = serde_json::from_value(serde_json::json!({
            "iat": 0, "iss": "", "jti": "", "nats": nats, "sub": key.public_key()
        }))
        .expect("claims");
        claims.encode(key).expect("encode")
    }

    #[test]
    fn a_signed_request_reads_back_and_a_forged_one_does_not() {
        let server = nkeys::KeyPair::new_server();
        let (req, token) = request(&server);
        let back = read_request(&token).expect("read");
        assert_eq!(back.user_nkey, req.user_nkey);
        assert_eq!(back.connect_opts.pass, "secret");
        assert_eq!(back.client_info.id, 7);
        let mut forged = token.clone();
        forged.truncate(forged.len() - 4);
        forged.push_str("AAAA");
        assert!(read_request(&forged).is_err());
        assert!(!format!("{back:?}").contains("secret"));
    }

    #[test]
    fn an_admission_limits_the_user_to_its_principal() {
        let server = nkeys::KeyPair::new_server();
        let issuer = nkeys::KeyPair::new_account();
        let (req, _) = request(&server);
        let p = Principal::Session(SessionId::new());
        let out = admit(&issuer, &req, &p, "TURNSTILE", Duration::from_secs(60)).expect("admit");
        let resp = decode(&out);
        assert_eq!(resp.iss, issuer.public_key());
        assert_eq!(resp.aud.as_deref(), Some(server.public_key().as_str()));
        assert_eq!(resp.sub, req.user_nkey);
        assert_eq!(resp.nats.0["type"], "authorization_response");
        let user = decode(resp.nats.0["jwt"].as_str().expect("jwt"));
        assert_eq!(user.aud.as_deref(), Some("TURNSTILE"));
        assert_eq!(user.sub, req.user_nkey);
        assert_eq!(user.iss, issuer.public_key());
        let perms = &user.nats.0;
        assert_eq!(perms["type"], "user");
        assert_eq!(
            perms["pub"]["allow"],
            serde_json::json!([format!("ts.api.steps.{p}.*"), format!("ts.api.exec.{p}.*")])
        );
        assert_eq!(
            perms["sub"]["allow"],
            serde_json::json!([format!("_INBOX.{p}.>")])
        );
        assert!(user.exp.is_some_and(|e| e > unix_now() as i64));
        let no = refuse(&issuer, &req, "session stopped").expect("refuse");
        let resp = decode(&no);
        assert_eq!(resp.nats.0["error"], "session stopped");
        assert!(resp.nats.0.get("jwt").is_none_or(|j| j == ""));
    }
}
