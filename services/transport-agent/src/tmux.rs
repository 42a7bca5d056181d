//! A thin async wrapper over the tmux CLI on the transport's private socket, so no other tmux
//! server on the host is touched and the panes survive the transport's own restarts.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::AsyncWriteExt;
use tokio::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum TmuxError {
    #[error("run tmux {args}: {source}")]
    Spawn {
        args: String,
        source: std::io::Error,
    },
    #[error("tmux {args} failed: {stderr}")]
    Failed { args: String, stderr: String },
    #[error("unexpected tmux output for {what}: {output:?}")]
    Parse { what: &'static str, output: String },
}

/// What a pane shows right now.
#[derive(Debug, Clone)]
pub struct PaneState {
    pub dead: bool,
    pub dead_status: Option<i32>,
    pub history_size: i64,
    pub cursor_y: i64,
    /// The visible screen, top to bottom, trailing spaces trimmed.
    pub screen: Vec<String>,
}

impl PaneState {
    /// The absolute line of the cursor, counting scrollback: grows as output scrolls by.
    /// The dead pane's exit status for evidence (`unknown` until tmux has it).
    pub fn exit_text(&self) -> String {
        self.dead_status.map_or("unknown".into(), |s| s.to_string())
    }

    pub fn cursor_line(&self) -> i64 {
        self.history_size + self.cursor_y
    }

    pub fn cursor_text(&self) -> &str {
        usize::try_from(self.cursor_y)
            .ok()
            .and_then(|y| self.screen.get(y))
            .map(String::as_str)
            .unwrap_or("")
    }

    /// The last `n` non-empty lines of the screen, for evidence.
    pub fn last_lines(&self, n: usize) -> Vec<String> {
        let mut lines: Vec<String> = self
            .screen
            .iter()
            .rev()
            .skip_while(|l| l.trim().is_empty())
            .take(n)
            .cloned()
            .collect();
        lines.reverse();
        lines
    }
}

#[derive(Debug, Clone)]
pub struct Tmux {
    socket: PathBuf,
    conf: PathBuf,
}

const CONF: &str = "set -g remain-on-exit on\nset -g history-limit 100000\nset -g status off\n";

impl Tmux {
    /// A tmux server on `<dir>/tmux.sock` configured for agents (dead panes stay readable).
    pub fn new(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let conf = dir.join("tmux.conf");
        std::fs::write(&conf, CONF)?;
        Ok(Self {
            socket: dir.join("tmux.sock"),
            conf,
        })
    }

    async fn run(&self, args: &[&str], stdin: Option<&[u8]>) -> Result<String, TmuxError> {
        let mut cmd = Command::new("tmux");
        cmd.arg("-S")
            .arg(&self.socket)
            .arg("-f")
            .arg(&self.conf)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .kill_on_drop(true);
        let joined = || args.join(" ");
        let mut child = cmd.spawn().map_err(|source| TmuxError::Spawn {
            args: joined(),
            source,
        })?;
        if let (Some(data), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(data)
                .await
                .map_err(|source| TmuxError::Spawn {
                    args: joined(),
                    source,
                })?;
        }
        let out = child
            .wait_with_output()
            .await
            .map_err(|source| TmuxError::Spawn {
                args: joined(),
                source,
            })?;
        if !out.status.success() {
            return Err(TmuxError::Failed {
                args: joined(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub async fn has_session(&self, name: &str) -> bool {
        self.run(&["has-session", "-t", &exact(name)], None)
            .await
            .is_ok()
    }

    pub async fn new_session(
        &self,
        name: &str,
        cwd: &Path,
        env: &[(&str, &str)],
        argv: &[&str],
    ) -> Result<(), TmuxError> {
        let cwd = cwd.to_string_lossy();
        let mut args = vec![
            "new-session",
            "-d",
            "-s",
            name,
            "-x",
            "200",
            "-y",
            "50",
            "-c",
            &cwd,
        ];
        let pairs: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        for p in &pairs {
            args.push("-e");
            args.push(p);
        }
        args.extend_from_slice(argv);
        self.run(&args, None).await.map(|_| ())
    }

    pub async fn kill_session(&self, name: &str) -> Result<(), TmuxError> {
        self.run(&["kill-session", "-t", &exact(name)], None)
            .await
            .map(|_| ())
    }

    /// Every pane on this server: `(session name, dead, exit status)`. Empty when no server
    /// runs (no agent was launched yet).
    pub async fn panes(&self) -> Vec<(String, bool, Option<i32>)> {
        let out = match self
            .run(
                &[
                    "list-panes",
                    "-a",
                    "-F",
                    "#{session_name}\t#{pane_dead}\t#{pane_dead_status}",
                ],
                None,
            )
            .await
        {
            Ok(o) => o,
            Err(_) => return Vec::new(),
        };
        out.lines()
            .filter_map(|l| {
                let mut f = l.split('\t');
                let name = f.next()?.to_string();
                let dead = f.next()? == "1";
                let status = f.next().and_then(|s| s.parse().ok());
                Some((name, dead, status))
            })
            .collect()
    }

    /// Pane metadata and the visible screen in one tmux call.
    pub async fn pane_state(&self, name: &str) -> Result<PaneState, TmuxError> {
        let target = pane(name);
        let out = self
            .run(
                &[
                    "display-message",
                    "-p",
                    "-t",
                    &target,
                    "#{pane_dead} #{pane_dead_status} #{history_size} #{cursor_y}",
                    ";",
                    "capture-pane",
                    "-p",
                    "-t",
                    &target,
                ],
                None,
            )
            .await?;
        let mut lines = out.lines();
        let meta = lines.next().unwrap_or_default();
        let parse_err = || TmuxError::Parse {
            what: "pane state",
            output: meta.to_string(),
        };
        let fields: Vec<&str> = meta.split(' ').collect();
        if fields.len() != 4 {
            return Err(parse_err());
        }
        Ok(PaneState {
            dead: fields[0] == "1",
            dead_status: fields[1].parse().ok(),
            history_size: fields[2].parse().map_err(|_| parse_err())?,
            cursor_y: fields[3].parse().map_err(|_| parse_err())?,
            screen: lines.map(|l| l.trim_end().to_string()).collect(),
        })
    }

    /// Lines `from..=to`, in absolute numbering (scrollback included), as of `state`.
    pub async fn capture_lines(
        &self,
        name: &str,
        state: &PaneState,
        from: i64,
        to: i64,
    ) -> Result<Vec<String>, TmuxError> {
        let start = (from - state.history_size).to_string();
        let end = (to - state.history_size).to_string();
        let out = self
            .run(
                &[
                    "capture-pane",
                    "-p",
                    "-J",
                    "-t",
                    &pane(name),
                    "-S",
                    &start,
                    "-E",
                    &end,
                ],
                None,
            )
            .await?;
        Ok(out.lines().map(|l| l.trim_end().to_string()).collect())
    }

    /// Types literal text as one message: a bracketed paste (multi-line text stays one
    /// message) and Enter, sent in ONE tmux command list so that a transport killed mid-way
    /// leaves either nothing typed or the whole message submitted, never a pasted but
    /// unsubmitted prompt.
    pub async fn type_message(
        &self,
        name: &str,
        buffer: &str,
        text: &str,
    ) -> Result<(), TmuxError> {
        self.run(&["load-buffer", "-b", buffer, "-"], Some(text.as_bytes()))
            .await?;
        let target = pane(name);
        self.run(
            &[
                "paste-buffer",
                "-p",
                "-d",
                "-b",
                buffer,
                "-t",
                &target,
                ";",
                "send-keys",
                "-t",
                &target,
                "Enter",
            ],
            None,
        )
        .await
        .map(|_| ())
    }
}

impl Tmux {
    /// Pastes literal text (a bracketed paste: several lines stay one message), without Enter.
    pub async fn paste(&self, name: &str, buffer: &str, text: &str) -> Result<(), TmuxError> {
        self.run(&["load-buffer", "-b", buffer, "-"], Some(text.as_bytes()))
            .await?;
        let target = pane(name);
        self.run(
            &["paste-buffer", "-p", "-d", "-b", buffer, "-t", &target],
            None,
        )
        .await
        .map(|_| ())
    }

    pub async fn press_enter(&self, name: &str) -> Result<(), TmuxError> {
        self.run(&["send-keys", "-t", &pane(name), "Enter"], None)
            .await
            .map(|_| ())
    }
}

fn exact(name: &str) -> String {
    format!("={name}")
}

fn pane(name: &str) -> String {
    format!("={name}:")
}
