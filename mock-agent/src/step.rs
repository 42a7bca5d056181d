//! Runs `turnstile step start …` for the `!step` directive, so the mock agent can start background command steps through the real step API the way an agent's tool call would.

use std::ffi::OsString;
use std::io::{self, ErrorKind, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::thread;
use std::time::{Duration, Instant};

use crate::step_spec::StepSpec;

/// Environment variable naming the turnstile executable; the agent's own executable otherwise.
pub const BIN_ENV: &str = "TURNSTILE_BIN";

/// How long to keep reading output after the CLI has exited, in case something it started
/// still holds its stdout or stderr open.
const DRAIN_GRACE: Duration = Duration::from_millis(250);

/// Starts the step(s) and waits for the CLI to exit; returns the reply lines to show.
pub fn start(spec: &StepSpec) -> Vec<String> {
    let exe = match turnstile_exe(std::env::var_os(BIN_ENV)) {
        Ok(exe) => exe,
        Err(err) => {
            return vec![failed(
                &spec.name,
                &format!("cannot locate the turnstile executable: {err}"),
            )]
        }
    };
    let mut command = Command::new(&exe);
    command.args(spec.cli_args(&exe.to_string_lossy()));
    run(command, &spec.name)
}

/// `TURNSTILE_BIN` when set and non-empty, else the running executable.
fn turnstile_exe(configured: Option<OsString>) -> io::Result<PathBuf> {
    match configured.filter(|value| !value.is_empty()) {
        Some(value) => Ok(PathBuf::from(value)),
        None => std::env::current_exe(),
    }
}

/// Runs `command` with a null stdin and captured output, inheriting the environment.
fn run(mut command: Command, name: &str) -> Vec<String> {
    let program = PathBuf::from(command.get_program());
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(err) => return vec![failed(name, &format!("{}: {err}", program.display()))],
    };
    let stdout = reader(child.stdout.take());
    let stderr = reader(child.stderr.take());
    let status = match child.wait() {
        Ok(status) => status,
        Err(err) => {
            return vec![failed(
                name,
                &format!("waiting for {}: {err}", program.display()),
            )]
        }
    };
    let deadline = Instant::now() + DRAIN_GRACE;
    let stdout = drain(&stdout, deadline);
    let stderr = drain(&stderr, deadline);
    reply_lines(name, status, &stdout, &stderr, &program)
}

/// The reply lines for a finished `step start`: its stdout lines, or one failure note.
fn reply_lines(
    name: &str,
    status: ExitStatus,
    stdout: &[u8],
    stderr: &[u8],
    program: &Path,
) -> Vec<String> {
    if status.success() {
        return non_empty_lines(stdout)
            .map(|line| format!("step {name}: {line}"))
            .collect();
    }
    let reason = match non_empty_lines(stderr).next() {
        Some(line) => line.to_string(),
        None => format!("{} exited with {status}", program.display()),
    };
    vec![failed(name, &reason)]
}

fn failed(name: &str, reason: &str) -> String {
    format!("step {name}: start failed: {reason}")
}

fn non_empty_lines(bytes: &[u8]) -> impl Iterator<Item = &str> {
    let text = std::str::from_utf8(bytes).unwrap_or("");
    text.lines().map(str::trim).filter(|line| !line.is_empty())
}

/// Reads a pipe to EOF on a thread, sending the chunks. The thread ends at EOF, on a read
/// error, or when the receiver is gone and more output arrives.
fn reader<R: Read + Send + 'static>(pipe: Option<R>) -> Receiver<Vec<u8>> {
    let (sender, receiver) = mpsc::channel();
    if let Some(mut pipe) = pipe {
        thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            loop {
                match pipe.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(count) => {
                        if sender.send(chunk[..count].to_vec()).is_err() {
                            break;
                        }
                    }
                    Err(err) if err.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => break,
                }
            }
        });
    }
    receiver
}

/// Everything the reader sent until EOF, or until `deadline` if the pipe stays open.
fn drain(receiver: &Receiver<Vec<u8>>, deadline: Instant) -> Vec<u8> {
    let mut bytes = Vec::new();
    while let Ok(chunk) = receiver.recv_timeout(deadline.saturating_duration_since(Instant::now()))
    {
        bytes.extend_from_slice(&chunk);
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::directives::{parse_line, Line};

    fn spec(directive: &str) -> StepSpec {
        match parse_line(directive) {
            Line::Step(spec) => spec,
            other => panic!("{directive:?} parsed as {other:?}"),
        }
    }

    /// A command running `script` with the step's CLI arguments as `$@`.
    fn fake_cli(script: &str, spec: &StepSpec) -> Command {
        let mut command = Command::new("sh");
        command.arg("-c").arg(script).arg("fake-turnstile");
        command.args(spec.cli_args("turnstile"));
        command
    }

    #[test]
    fn passes_the_arguments_and_prefixes_stdout_lines() {
        let spec = spec("!step build 0.5 fail --scope run --count 2");
        let lines = run(fake_cli(r#"printf '%s\n' "$@""#, &spec), &spec.name);
        let expected: Vec<String> = [
            "step",
            "start",
            "--name",
            "build",
            "--scope",
            "run",
            "--count",
            "2",
            "--",
            "sh",
            "-c",
            "sleep 0.5; exit 1",
        ]
        .iter()
        .map(|arg| format!("step build: {arg}"))
        .collect();
        assert_eq!(lines, expected);
    }

    #[test]
    fn skips_blank_stdout_lines() {
        let spec = spec("!step t 1");
        let script = r"printf 'stp_1 started\n\n  \nstp_2 started\r\n'";
        assert_eq!(
            run(fake_cli(script, &spec), "t"),
            vec!["step t: stp_1 started", "step t: stp_2 started"]
        );
        assert!(run(fake_cli("true", &spec), "t").is_empty());
    }

    #[test]
    fn stdin_is_null() {
        let spec = spec("!step t 1");
        let script = r#"if read -r line; then echo "read $line"; else echo eof; fi"#;
        assert_eq!(run(fake_cli(script, &spec), "t"), vec!["step t: eof"]);
    }

    #[test]
    fn inherits_the_environment() {
        let spec = spec("!step t 1");
        let mut command = fake_cli(r#"echo "session=$TURNSTILE_SESSION""#, &spec);
        command.env("TURNSTILE_SESSION", "ses_x");
        assert_eq!(run(command, "t"), vec!["step t: session=ses_x"]);
    }

    #[test]
    fn failure_reports_first_stderr_line() {
        let spec = spec("!step t 1");
        let script = r"echo 'stp_1 started'; printf '\n  \nerror: no session\nmore\n' >&2; exit 2";
        assert_eq!(
            run(fake_cli(script, &spec), "t"),
            vec!["step t: start failed: error: no session"]
        );
    }

    #[test]
    fn failure_without_stderr_reports_the_status() {
        let spec = spec("!step t 1");
        let lines = run(fake_cli("exit 3", &spec), "t");
        assert_eq!(lines.len(), 1);
        assert!(
            lines[0].starts_with("step t: start failed: sh exited with exit status: 3"),
            "{lines:?}"
        );
    }

    #[test]
    fn spawn_error_is_reported() {
        let missing = std::env::temp_dir().join(format!(
            "turnstile-mock-agent-missing-{}",
            uuid::Uuid::new_v4().simple()
        ));
        let lines = run(Command::new(&missing), "t");
        assert_eq!(lines.len(), 1);
        let prefix = format!("step t: start failed: {}: ", missing.display());
        assert!(lines[0].starts_with(&prefix), "{lines:?}");
    }

    #[test]
    fn returns_when_the_cli_exits_even_if_a_child_keeps_the_pipe() {
        let spec = spec("!step t 1");
        let started = Instant::now();
        let lines = run(fake_cli("sleep 3 & echo 'stp_1 started'", &spec), "t");
        assert_eq!(lines, vec!["step t: stp_1 started"]);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn chooses_the_executable() {
        assert_eq!(
            turnstile_exe(Some("/opt/turnstile".into())).unwrap(),
            PathBuf::from("/opt/turnstile")
        );
        let own = std::env::current_exe().unwrap();
        assert_eq!(turnstile_exe(Some(OsString::new())).unwrap(), own);
        assert_eq!(turnstile_exe(None).unwrap(), own);
    }
}
