//! `turnstile session ...`: thin calls to the session-lane API, printed for people or as JSON.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Subcommand;
use turnstile_shared::api::{self, CreateSession, ListSessions, SendTurn, SessionRef, SessionView};
use turnstile_shared::duration;
use turnstile_shared::records::{AgentKind, LaunchSpec, SessionRecord, TurnRecord, TurnState};
use turnstile_shared::subjects::{self, api as subj};
use turnstile_shared::{HostName, SessionId, TurnId};

const API_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a create or send keeps retrying a request lost with a replica or a server (its
/// id, chosen here, makes a repeat return the first attempt's session or turn).
const RETRY_DEADLINE: Duration = Duration::from_secs(30);

#[derive(Subcommand)]
pub enum SessionCommand {
    /// Create a session; prints its id alone.
    Create {
        #[arg(long, default_value = "mock")]
        agent: AgentKind,
        #[arg(long)]
        name: String,
        /// Pin the session to this host (default: the live host with the fewest sessions).
        #[arg(long)]
        host: Option<HostName>,
        #[arg(long)]
        cwd: Option<PathBuf>,
        /// How long a launch or resume may take to reach a ready prompt (R9); the host's
        /// `--ready-timeout` when absent.
        #[arg(long, value_parser = duration::parse_flag)]
        ready_timeout: Option<Duration>,
        /// What the agent may do without asking: a comma-separated list of `edits`, `shell`,
        /// `network`, or `all` / `none` (default `edits,shell`). Anything else it tries is
        /// refused at once and fails the turn `permission_denied`; the Turnstile tools are
        /// always allowed.
        #[arg(long)]
        allow: Option<turnstile_shared::policy::Policy>,
        /// One more allow rule of the CLI's own, as it spells them (Claude:
        /// `--allow-tool 'Bash(git *)'`); repeatable.
        #[arg(long = "allow-tool")]
        allow_tool: Vec<String>,
        /// Agent `tmux`: a regular expression the cursor line matches when the CLI waits for
        /// input (its prompt; anchor it, e.g. `'^> $'`).
        #[arg(long)]
        ready: Option<String>,
        /// Agent `tmux`: a regular expression some screen line matches while the CLI works
        /// (a spinner's label); while it matches, the CLI is not ready.
        #[arg(long)]
        busy: Option<String>,
        /// Agent `tmux`: the command to run, one string split like a shell's words (quotes
        /// group, no expansion; no shell runs it), e.g. `--launch 'aider --no-auto-commits'`.
        #[arg(long, allow_hyphen_values = true)]
        launch: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// List sessions with their lane state.
    List {
        #[command(flatten)]
        page: crate::paging::PageArgs,
        #[arg(long)]
        json: bool,
    },
    /// One session: idle or busy (with the item in flight), queued count, host, transport.
    Show {
        id: SessionId,
        #[arg(long)]
        json: bool,
    },
    /// Queue a message as a turn; with --wait, exit 0 if it completed and 1 if it failed.
    Send {
        id: SessionId,
        /// The message, verbatim (it may start with `-`).
        #[arg(allow_hyphen_values = true)]
        text: String,
        #[arg(long)]
        wait: bool,
        /// With --wait: give up waiting after this long (exit 3); the turn goes on.
        #[arg(long, default_value = "1h", value_parser = duration::parse_flag)]
        timeout: Duration,
        #[arg(long)]
        json: bool,
    },
    /// Stop a session: its terminal ends and its queued turns fail with `session_stopped`.
    Stop {
        id: SessionId,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(url: &str, cmd: SessionCommand) -> anyhow::Result<ExitCode> {
    let client = turnstile_shared::config::connect_once(url, "turnstile-cli").await?;
    match cmd {
        SessionCommand::Create {
            agent,
            name,
            host,
            cwd,
            ready_timeout,
            allow,
            allow_tool,
            ready,
            busy,
            launch,
            json,
        } => {
            let launch = match (launch, ready) {
                (None, None) if busy.is_none() => None,
                (Some(command), Some(ready)) => Some(LaunchSpec {
                    argv: shlex::split(&command).with_context(|| {
                        format!("--launch {command:?}: an unclosed quote or a stray backslash")
                    })?,
                    ready,
                    busy,
                }),
                _ => anyhow::bail!(
                    "a tmux session needs --launch COMMAND and --ready REGEX (and optionally --busy REGEX)"
                ),
            };
            let policy = match (allow, allow_tool.is_empty()) {
                (None, true) => None,
                (allow, _) => {
                    let mut p = allow.unwrap_or_default();
                    p.tools = allow_tool;
                    Some(p)
                }
            };
            let cwd = cwd.map(|p| std::path::absolute(&p).unwrap_or(p));
            let req = CreateSession {
                agent,
                name,
                host,
                cwd: cwd.map(|p| p.to_string_lossy().into_owned()),
                id: Some(SessionId::new()),
                launch,
                ready_timeout_ms: ready_timeout.map(|d| d.as_millis() as u64),
                policy,
            };
            let rec: SessionRecord = api::call_idempotent(
                &client,
                subj::SESSION_CREATE,
                &req,
                API_TIMEOUT,
                RETRY_DEADLINE,
            )
            .await?;
            if json {
                println!("{}", serde_json::to_string(&rec)?);
            } else {
                println!("{}", rec.id);
            }
        }
        SessionCommand::List { page, json } => {
            let req = ListSessions {
                page: page.request(),
            };
            let page: turnstile_shared::page::Page<SessionView> =
                api::call(&client, subj::SESSION_LIST, &req, API_TIMEOUT).await?;
            let views = &page.items;
            if json {
                println!("{}", serde_json::to_string(&page)?);
            } else {
                crate::paging::more(&page);
                println!(
                    "{:<36} {:<16} {:<8} {:<12} {:<8} {:>6}  transport",
                    "SESSION", "NAME", "AGENT", "HOST", "STATE", "QUEUED"
                );
                for v in views {
                    println!(
                        "{:<36} {:<16} {:<8} {:<12} {:<8} {:>6}  {}",
                        v.session.id,
                        v.session.name,
                        v.session.agent,
                        v.session.host,
                        state(v),
                        v.queued,
                        v.transport
                    );
                }
            }
        }
        SessionCommand::Show { id, json } => {
            let v: SessionView = api::call(
                &client,
                subj::SESSION_SHOW,
                &SessionRef { session: id },
                API_TIMEOUT,
            )
            .await?;
            if json {
                println!("{}", serde_json::to_string(&v)?);
            } else {
                print_view(&v);
            }
        }
        SessionCommand::Send {
            id,
            text,
            wait,
            timeout,
            json,
        } => return send(&client, id, text, wait, timeout, json).await,
        SessionCommand::Stop { id, json } => {
            let rec: SessionRecord = api::call(
                &client,
                subj::SESSION_STOP,
                &SessionRef { session: id },
                API_TIMEOUT,
            )
            .await?;
            if json {
                println!("{}", serde_json::to_string(&rec)?);
            } else {
                println!("stopped {}", rec.id);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn state(v: &SessionView) -> &'static str {
    match (&v.session.state, v.busy) {
        (turnstile_shared::records::SessionState::Stopped { .. }, _) => "stopped",
        (_, true) => "busy",
        (_, false) => "idle",
    }
}

fn print_view(v: &SessionView) {
    let s = &v.session;
    println!("session    {} ({})", s.id, s.name);
    println!("agent      {}", s.agent);
    println!("host       {} (transport {})", s.host, v.transport);
    if let Some(c) = &s.conversation {
        println!("conversation {c}");
    }
    match &v.in_flight {
        Some(t) => println!(
            "state      busy: {} {} {:?}",
            t.id,
            t.state.name(),
            first_line(&t.text)
        ),
        None => println!("state      {}", state(v)),
    }
    println!("queued     {}", v.queued);
}

fn first_line(s: &str) -> String {
    let line = s.lines().next().unwrap_or_default();
    line.chars().take(60).collect()
}

async fn send(
    client: &async_nats::Client,
    session: SessionId,
    text: String,
    wait: bool,
    timeout: Duration,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let turn = TurnId::new();
    // Watch before sending, so the outcome cannot slip by between the two.
    let waiting = if wait {
        Some(crate::wait::RecordWait::start(client, subjects::TURNS_BUCKET, turn.as_str()).await?)
    } else {
        None
    };
    let req = SendTurn {
        session,
        text,
        turn: Some(turn.clone()),
    };
    let rec: TurnRecord = api::call_idempotent(
        client,
        subj::SESSION_SEND,
        &req,
        API_TIMEOUT,
        RETRY_DEADLINE,
    )
    .await?;
    let Some(waiting) = waiting else {
        if json {
            println!("{}", serde_json::to_string(&rec)?);
        } else {
            println!("{}", rec.id);
        }
        return Ok(ExitCode::SUCCESS);
    };
    let ended = waiting.until(|r: &TurnRecord| r.state.is_terminal());
    let rec = match tokio::time::timeout(timeout, ended).await {
        Ok(r) => r,
        Err(_) => {
            eprintln!("turn {turn} still running after {timeout:?}");
            return Ok(ExitCode::from(3));
        }
    };
    if json {
        println!("{}", serde_json::to_string(&rec)?);
    }
    match &rec.state {
        TurnState::Completed { output, .. } => {
            if !json {
                println!("{} completed", rec.id);
                for l in output {
                    println!("  {l}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        TurnState::Failed {
            reason,
            detail,
            output,
            ..
        } => {
            if !json {
                println!("{} failed: {reason}: {detail}", rec.id);
                for l in output {
                    println!("  {l}");
                }
            }
            Ok(ExitCode::from(1))
        }
        _ => Ok(ExitCode::from(1)),
    }
}
