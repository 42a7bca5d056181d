//! `turnstile mock-agent`: a fake interactive coding-agent CLI that runs in a tmux pane so
//! Turnstile can be tested and demoed without a real agent.
//!
//! The agent prints a banner and a `❯ ` prompt, accepts typed or bracketed-pasted messages,
//! records each one to `<state_dir>/<conversation-id>.jsonl`, obeys `!sleep`, `!reply`,
//! `!exit`, `!hang` and `!step` directives and answers with a `● …` reply followed by a fresh
//! prompt.
//!
//! Directives, one per line of a message (other lines are prose):
//!
//! - `!sleep DUR`: show the spinner for `DUR` (`500ms`, `2s`, `1.5`, `1m`, `1h30m`: the one
//!   duration grammar of `turnstile_shared::duration`).
//! - `!reply TEXT`: a reply line; any `!reply` replaces the default `ok: <first prose line>`.
//! - `!exit [CODE]`: exit with `CODE` (default 0) without replying.
//! - `!hang`: spin until the terminal goes away.
//! - `!step NAME DUR [ok|fail] [--scope turn|session|detached] [--count N] [--trace F]`: run
//!   `<turnstile> step start --name NAME [--scope S] [--count N] -- sleep SECS` (or
//!   `sh -c "sleep SECS; exit 1"` for `fail`) and wait for it to exit, where `<turnstile>` is
//!   `$TURNSTILE_BIN` or this executable. Each line it prints becomes a `step NAME: …` reply
//!   line; a failure becomes `step NAME: start failed: …`. Neither replaces the default reply.
//!
//! # Layout
//!
//! [`run`] opens the transcript, engages the terminal and hands over to `session`. Calls go
//! down this list, never up:
//!
//! * `session`: the conversation loop (read, echo, record, act, reply). Calls everything below.
//! * `directives`: a message's directives and prose, and its reply. Calls `groups`, `step_spec`.
//! * `groups`: the `!groups` plan (one step per turn), kept on disk. Calls `step_spec`.
//! * `step`: runs `turnstile step start` for a `!step` and reads its output. Calls `step_spec`.
//! * `step_spec`: a `!step`'s arguments and the command line they become. Leaf.
//! * `input`: raw terminal bytes to submitted messages (line editing, paste). Leaf.
//! * `spinner`: the "working…" line while busy. Leaf.
//! * `terminal`: raw mode and bracketed paste for the agent's lifetime. Leaf.
//! * `transcript`: the JSONL record of submitted messages, one file per conversation. Leaf.

mod directives;
mod groups;
mod input;
mod session;
mod spinner;
mod step;
mod step_spec;
mod terminal;
mod transcript;

use std::io;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use session::{drive, Session};
use terminal::TerminalGuard;
use transcript::{count_messages, transcript_path, Transcript};

/// Command-line arguments of `turnstile mock-agent`.
#[derive(Debug, Clone)]
pub struct Args {
    /// Directory holding one `<conversation-id>.jsonl` transcript per conversation.
    pub state_dir: PathBuf,
    /// Conversation id to continue instead of starting a new one.
    pub resume: Option<String>,
}

/// Runs until stdin closes or an `!exit` directive; returns the process exit code to use.
/// True while the file named by `TURNSTILE_MOCK_FAIL_RESUME_FILE` exists.
fn resume_refused() -> bool {
    std::env::var_os("TURNSTILE_MOCK_FAIL_RESUME_FILE")
        .filter(|p| !p.is_empty())
        .is_some_and(|p| std::path::Path::new(&p).exists())
}

pub fn run(args: Args) -> Result<i32> {
    let (conversation, resumed) = match args.resume {
        Some(id) => {
            validate_conversation_id(&id)?;
            if resume_refused() {
                // Fault tests: a resume that cannot come back (R9).
                println!(
                    "error: conversation {id} cannot be resumed (TURNSTILE_MOCK_FAIL_RESUME_FILE)"
                );
                return Ok(3);
            }
            (id, true)
        }
        None => (new_conversation_id(), false),
    };
    std::fs::create_dir_all(&args.state_dir)
        .with_context(|| format!("creating state dir {}", args.state_dir.display()))?;
    let earlier = if resumed {
        Some(count_messages(&transcript_path(
            &args.state_dir,
            &conversation,
        ))?)
    } else {
        None
    };
    let transcript = Transcript::open(&args.state_dir, &conversation)?;

    let _terminal = TerminalGuard::engage();
    let stdout = io::stdout();
    let mut session = Session::new(stdout.lock(), transcript, conversation);
    session.banner(earlier)?;
    let stdin = io::stdin();
    drive(&mut session, stdin.lock())
}

/// A fresh conversation id: `cnv_` followed by 32 lowercase hex digits.
fn new_conversation_id() -> String {
    format!("cnv_{}", uuid::Uuid::new_v4().simple())
}

/// Conversation ids become file names, so only `[A-Za-z0-9_-]` is allowed.
fn validate_conversation_id(id: &str) -> Result<()> {
    if id.is_empty() {
        bail!("conversation id to resume is empty");
    }
    if let Some(bad) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        bail!(
            "conversation id {id:?} contains {bad:?}; only A-Z, a-z, 0-9, '_' and '-' are allowed"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_ids_are_cnv_plus_32_hex() {
        let id = new_conversation_id();
        let hex = id.strip_prefix("cnv_").unwrap();
        assert_eq!(hex.len(), 32);
        assert!(hex
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert!(validate_conversation_id(&id).is_ok());
        assert_ne!(id, new_conversation_id());
    }

    #[test]
    fn validates_resume_ids() {
        assert!(validate_conversation_id("cnv_abc-DEF_123").is_ok());
        for bad in ["", "../etc", "a b", "a/b", "a.jsonl", "é"] {
            assert!(validate_conversation_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn bad_resume_id_is_rejected_before_touching_disk() {
        let dir = std::env::temp_dir().join(format!(
            "turnstile-mock-agent-never-{}",
            uuid::Uuid::new_v4().simple()
        ));
        let err = run(Args {
            state_dir: dir.clone(),
            resume: Some("../x".into()),
        })
        .unwrap_err();
        assert!(err.to_string().contains("../x"), "{err}");
        assert!(!dir.exists());
    }
}
