//! Interprets the lines of a submitted message (`!sleep`, `!reply`, `!exit`, `!hang`, `!step`, prose) and builds the reply text, without doing any IO.

use std::time::Duration;

use crate::duration::parse_duration;

/// Maximum number of characters of prose quoted in the default reply.
const DEFAULT_REPLY_CHARS: usize = 60;

/// What one line of a message asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// `!sleep DUR`: show the spinner for this long.
    Sleep(Duration),
    /// `!reply TEXT`: one line of the reply.
    Reply(String),
    /// `!exit [CODE]`: stop and exit with this code.
    Exit(i32),
    /// `!hang`: spin forever.
    Hang,
    /// `!step NAME DURATION [ok|fail] [--scope S] [--count N]`: start background command step(s).
    Step(StepSpec),
    /// `!groups N DUR [--scope S]`: work through N groups, one step per turn.
    Groups(crate::groups::Plan),
    /// A directive that could not be honoured; the text becomes a reply line.
    Note(String),
    /// Anything that is not a directive.
    Prose(String),
}

/// Classifies one line of a message. Lines whose trimmed text starts with `!` are directives.
pub fn parse_line(line: &str) -> Line {
    let trimmed = line.trim();
    let Some(body) = trimmed.strip_prefix('!') else {
        return Line::Prose(line.to_string());
    };
    let (word, arg) = match body.split_once(char::is_whitespace) {
        Some((word, arg)) => (word, arg.trim()),
        None => (body, ""),
    };
    match word {
        "sleep" => match parse_duration(arg) {
            Ok(duration) => Line::Sleep(duration),
            Err(err) => Line::Note(format!("invalid directive: !sleep {arg} ({err})")),
        },
        "reply" => Line::Reply(arg.to_string()),
        "exit" if arg.is_empty() => Line::Exit(0),
        "exit" => match arg.parse::<i32>() {
            Ok(code) => Line::Exit(code),
            Err(err) => Line::Note(format!("invalid directive: !exit {arg} ({err})")),
        },
        "hang" => Line::Hang,
        "groups" => match crate::groups::Plan::parse(arg) {
            Ok(plan) => Line::Groups(plan),
            Err(err) => Line::Note(format!("invalid directive: !groups {arg} ({err})")),
        },
        "step" => match StepSpec::parse(arg) {
            Ok(spec) => Line::Step(spec),
            Err(reason) => Line::Note(format!("invalid directive: !step {arg} ({reason})")),
        },
        _ => Line::Note(format!("unknown directive: !{word}")),
    }
}

/// How the command of a `!step` ends once its sleep is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    /// `sleep SECS`: exits 0.
    Ok,
    /// `sh -c "sleep SECS; exit 1"`: exits 1.
    Fail,
}

/// The `--scope` handed to `turnstile step start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepScope {
    Turn,
    Run,
    Detached,
}

impl StepScope {
    pub(crate) fn parse(text: &str) -> Option<Self> {
        match text {
            "turn" => Some(Self::Turn),
            "run" => Some(Self::Run),
            "detached" => Some(Self::Detached),
            _ => None,
        }
    }

    /// The value as the CLI spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Turn => "turn",
            Self::Run => "run",
            Self::Detached => "detached",
        }
    }
}

/// The arguments of a `!step` directive.
///
/// Grammar (whitespace-separated tokens): `NAME DURATION [ok|fail]` as positionals in that order,
/// with `--scope turn|run|detached` and `--count N` (or `--scope=S`, `--count=N`) anywhere among them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepSpec {
    /// The step name (`--name`); one token, not starting with `-`.
    pub name: String,
    /// How long the step's command sleeps.
    pub duration: Duration,
    /// Whether the command exits 0 or 1 after sleeping (default `ok`).
    pub outcome: StepOutcome,
    /// `--scope`, passed on only when given.
    pub scope: Option<StepScope>,
    /// `--count` (at least 1), passed on only when given.
    pub count: Option<u32>,
}

impl StepSpec {
    /// Parses the text after `!step`; the error is a short reason for the `invalid directive` note.
    pub fn parse(arg: &str) -> Result<Self, String> {
        let mut tokens = arg.split_whitespace();
        let mut positionals = Vec::new();
        let mut scope = None;
        let mut count = None;
        while let Some(token) = tokens.next() {
            let Some(option) = token.strip_prefix("--") else {
                positionals.push(token);
                continue;
            };
            let (key, inline) = match option.split_once('=') {
                Some((key, value)) => (key, Some(value)),
                None => (option, None),
            };
            match key {
                "scope" | "count" => {}
                _ => return Err(format!("unknown option {token:?}")),
            }
            let value = inline
                .or_else(|| tokens.next())
                .filter(|value| !value.is_empty())
                .ok_or_else(|| format!("--{key} needs a value"))?;
            if key == "scope" {
                if scope.is_some() {
                    return Err("--scope given twice".to_string());
                }
                scope = Some(StepScope::parse(value).ok_or_else(|| {
                    format!("unknown scope {value:?}; use turn, run or detached")
                })?);
            } else {
                if count.is_some() {
                    return Err("--count given twice".to_string());
                }
                let n: u32 = value
                    .parse()
                    .map_err(|err| format!("invalid --count {value:?}: {err}"))?;
                if n == 0 {
                    return Err("--count must be at least 1".to_string());
                }
                count = Some(n);
            }
        }
        let mut positionals = positionals.into_iter();
        let name = positionals.next().ok_or("missing step name and duration")?;
        if name.starts_with('-') {
            return Err(format!("step name {name:?} must not start with '-'"));
        }
        let duration = positionals.next().ok_or("missing duration")?;
        let duration = parse_duration(duration).map_err(|err| err.to_string())?;
        let outcome = match positionals.next() {
            None | Some("ok") => StepOutcome::Ok,
            Some("fail") => StepOutcome::Fail,
            Some(other) => return Err(format!("unknown outcome {other:?}; use ok or fail")),
        };
        if let Some(extra) = positionals.next() {
            return Err(format!("unexpected argument {extra:?}"));
        }
        Ok(Self {
            name: name.to_string(),
            duration,
            outcome,
            scope,
            count,
        })
    }

    /// The arguments after the turnstile executable:
    /// `step start --name NAME [--scope S] [--count N] -- <command>`.
    pub fn cli_args(&self) -> Vec<String> {
        let mut args: Vec<String> = vec!["step".into(), "start".into(), "--name".into()];
        args.push(self.name.clone());
        if let Some(scope) = self.scope {
            args.push("--scope".into());
            args.push(scope.as_str().into());
        }
        if let Some(count) = self.count {
            args.push("--count".into());
            args.push(count.to_string());
        }
        args.push("--".into());
        let seconds = decimal_seconds(self.duration);
        match self.outcome {
            StepOutcome::Ok => {
                args.push("sleep".into());
                args.push(seconds);
            }
            StepOutcome::Fail => {
                args.push("sh".into());
                args.push("-c".into());
                args.push(format!("sleep {seconds}; exit 1"));
            }
        }
        args
    }
}

/// A duration as plain decimal seconds for `sleep`: `2`, `0.5`, `60`, `0.001` (exact, no exponent).
fn decimal_seconds(duration: Duration) -> String {
    let secs = duration.as_secs();
    let nanos = duration.subsec_nanos();
    if nanos == 0 {
        return secs.to_string();
    }
    let fraction = format!("{nanos:09}");
    format!("{secs}.{}", fraction.trim_end_matches('0'))
}

/// Collects reply lines while a message is processed and produces the final reply.
#[derive(Debug, Default)]
pub struct ReplyBuilder {
    lines: Vec<String>,
    explicit: bool,
    first_prose: Option<String>,
}

impl ReplyBuilder {
    /// Records a line's contribution to the reply (sleep/exit/hang contribute nothing).
    pub fn add(&mut self, line: &Line) {
        match line {
            Line::Reply(text) => {
                self.explicit = true;
                self.lines.push(text.clone());
            }
            Line::Note(text) => self.lines.push(text.clone()),
            Line::Prose(text) => {
                if self.first_prose.is_none() && !text.trim().is_empty() {
                    self.first_prose = Some(text.trim().to_string());
                }
            }
            Line::Sleep(_) | Line::Exit(_) | Line::Hang | Line::Step(_) | Line::Groups(_) => {}
        }
    }

    /// Adds a line that, like a note, does not replace the default `ok: …` reply.
    pub fn note(&mut self, text: String) {
        self.lines.push(text);
    }

    /// The reply lines: the `!reply` texts, or else the default `ok: …` line, plus any notes in order.
    pub fn finish(self) -> Vec<String> {
        let mut lines = self.lines;
        if !self.explicit {
            let default = match self.first_prose {
                Some(prose) => {
                    let quoted: String = prose.chars().take(DEFAULT_REPLY_CHARS).collect();
                    format!("ok: {quoted}")
                }
                None => "ok".to_string(),
            };
            lines.insert(0, default);
        }
        lines
    }
}

/// Renders reply lines as `● first` with continuation lines indented by two spaces, each ending in `\n`.
pub fn render_reply(lines: &[String]) -> String {
    let mut out = String::new();
    for (index, line) in lines.iter().enumerate() {
        out.push_str(if index == 0 { "● " } else { "  " });
        out.push_str(&printable(line));
        out.push('\n');
    }
    if lines.is_empty() {
        out.push_str("● \n");
    }
    out
}

/// The echo of a submitted message: its first line, plus ` [+K more lines]` when it has more.
pub fn render_echo(message: &str) -> String {
    let mut lines = message.lines();
    let first = lines.next().unwrap_or("");
    let more = lines.count();
    let mut out = printable(first);
    if more > 0 {
        out.push_str(&format!(" [+{more} more lines]"));
    }
    out.push('\n');
    out
}

/// Drops control characters (other than tab) so echoed text cannot drive the terminal.
fn printable(text: &str) -> String {
    text.chars()
        .filter(|&c| c == '\t' || !c.is_control())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply_for(message: &str) -> Vec<String> {
        let mut builder = ReplyBuilder::default();
        for line in message.lines() {
            builder.add(&parse_line(line));
        }
        builder.finish()
    }

    #[test]
    fn classifies_directives() {
        assert_eq!(
            parse_line("!sleep 500ms"),
            Line::Sleep(Duration::from_millis(500))
        );
        assert_eq!(
            parse_line("  !sleep 2 "),
            Line::Sleep(Duration::from_secs(2))
        );
        assert_eq!(
            parse_line("!reply hi there"),
            Line::Reply("hi there".into())
        );
        assert_eq!(parse_line("!reply"), Line::Reply(String::new()));
        assert_eq!(parse_line("!exit"), Line::Exit(0));
        assert_eq!(parse_line("!exit 3"), Line::Exit(3));
        assert_eq!(parse_line("!hang"), Line::Hang);
        assert_eq!(
            parse_line("!frobnicate now"),
            Line::Note("unknown directive: !frobnicate".into())
        );
        assert_eq!(parse_line("plain text"), Line::Prose("plain text".into()));
    }

    #[test]
    fn bad_arguments_become_notes() {
        assert!(
            matches!(parse_line("!sleep soon"), Line::Note(n) if n.starts_with("invalid directive: !sleep soon"))
        );
        assert!(
            matches!(parse_line("!exit x"), Line::Note(n) if n.starts_with("invalid directive: !exit x"))
        );
    }

    fn step(arg: &str) -> StepSpec {
        StepSpec::parse(arg).unwrap_or_else(|err| panic!("{arg:?}: {err}"))
    }

    fn step_error(arg: &str) -> String {
        StepSpec::parse(arg).expect_err(arg)
    }

    fn args(spec: &StepSpec) -> Vec<String> {
        spec.cli_args()
    }

    #[test]
    fn step_defaults() {
        let spec = step("build 2s");
        assert_eq!(
            spec,
            StepSpec {
                name: "build".into(),
                duration: Duration::from_secs(2),
                outcome: StepOutcome::Ok,
                scope: None,
                count: None,
            }
        );
        assert_eq!(
            args(&spec),
            ["step", "start", "--name", "build", "--", "sleep", "2"]
        );
        assert_eq!(parse_line("  !step build 2s  "), Line::Step(spec));
    }

    #[test]
    fn step_outcomes() {
        assert_eq!(step("t 1 ok").outcome, StepOutcome::Ok);
        let spec = step("tests 500ms fail");
        assert_eq!(spec.outcome, StepOutcome::Fail);
        assert_eq!(
            args(&spec),
            [
                "step",
                "start",
                "--name",
                "tests",
                "--",
                "sh",
                "-c",
                "sleep 0.5; exit 1"
            ]
        );
    }

    #[test]
    fn step_scope_and_count() {
        for (word, scope) in [
            ("turn", StepScope::Turn),
            ("run", StepScope::Run),
            ("detached", StepScope::Detached),
        ] {
            let spec = step(&format!("s 1 --scope {word}"));
            assert_eq!(spec.scope, Some(scope));
            assert_eq!(scope.as_str(), word);
            assert_eq!(
                args(&spec),
                ["step", "start", "--name", "s", "--scope", word, "--", "sleep", "1"]
            );
        }
        let spec = step("s 1m fail --scope detached --count 3");
        assert_eq!(spec.count, Some(3));
        assert_eq!(
            args(&spec),
            [
                "step",
                "start",
                "--name",
                "s",
                "--scope",
                "detached",
                "--count",
                "3",
                "--",
                "sh",
                "-c",
                "sleep 60; exit 1"
            ]
        );
        assert_eq!(
            args(&step("s 1 --count 2")),
            ["step", "start", "--name", "s", "--count", "2", "--", "sleep", "1"]
        );
    }

    #[test]
    fn step_options_go_anywhere_and_take_equals() {
        let expected = step("s 2 fail --scope run --count 4");
        for arg in [
            "--scope run s 2 fail --count 4",
            "s --count 4 2 --scope run fail",
            "s 2 fail --scope=run --count=4",
            "--count=4 --scope=run s\t2   fail",
        ] {
            assert_eq!(step(arg), expected, "{arg:?}");
        }
    }

    #[test]
    fn step_seconds_formatting() {
        for (duration, seconds) in [
            ("2", "2"),
            ("2s", "2"),
            ("60s", "60"),
            ("1m", "60"),
            ("1h", "3600"),
            ("500ms", "0.5"),
            ("0.5", "0.5"),
            ("1.5s", "1.5"),
            ("1.25", "1.25"),
            ("100ms", "0.1"),
            ("1ms", "0.001"),
            ("1500ms", "1.5"),
            ("0", "0"),
            ("0ms", "0"),
        ] {
            let spec = step(&format!("s {duration}"));
            assert_eq!(
                args(&spec).last().map(String::as_str),
                Some(seconds),
                "{duration:?}"
            );
        }
        assert_eq!(decimal_seconds(Duration::new(3, 1)), "3.000000001");
        assert_eq!(decimal_seconds(Duration::new(0, 120_000_000)), "0.12");
    }

    #[test]
    fn step_errors() {
        assert_eq!(step_error(""), "missing step name and duration");
        assert_eq!(step_error("--count 2"), "missing step name and duration");
        assert_eq!(step_error("build"), "missing duration");
        assert!(step_error("build soon").contains("does not start with a number"));
        assert!(step_error("build 5x").contains("unknown unit"));
        assert!(step_error("build -1s").contains("does not start with a number"));
        assert_eq!(
            step_error("build 1 maybe"),
            r#"unknown outcome "maybe"; use ok or fail"#
        );
        assert_eq!(
            step_error("build 1 ok fail"),
            r#"unexpected argument "fail""#
        );
        assert_eq!(
            step_error("-b 1"),
            r#"step name "-b" must not start with '-'"#
        );
        assert_eq!(step_error("b 1 --verbose"), r#"unknown option "--verbose""#);
        assert_eq!(step_error("b 1 --scope"), "--scope needs a value");
        assert_eq!(step_error("b 1 --scope="), "--scope needs a value");
        assert_eq!(
            step_error("b 1 --scope session"),
            r#"unknown scope "session"; use turn, run or detached"#
        );
        assert_eq!(
            step_error("b 1 --scope run --scope turn"),
            "--scope given twice"
        );
        assert_eq!(step_error("b 1 --count"), "--count needs a value");
        assert_eq!(step_error("b 1 --count 0"), "--count must be at least 1");
        assert!(step_error("b 1 --count -1").starts_with(r#"invalid --count "-1""#));
        assert!(step_error("b 1 --count two").starts_with(r#"invalid --count "two""#));
        assert!(step_error("b 1 --count 99999999999").starts_with("invalid --count"));
        assert_eq!(step_error("b 1 --count 1 --count 2"), "--count given twice");
    }

    #[test]
    fn invalid_step_becomes_a_note() {
        assert_eq!(
            parse_line("!step build"),
            Line::Note("invalid directive: !step build (missing duration)".into())
        );
        assert_eq!(
            parse_line("!step"),
            Line::Note("invalid directive: !step  (missing step name and duration)".into())
        );
        assert_eq!(
            parse_line("!step b 1 --scope x"),
            Line::Note(
                r#"invalid directive: !step b 1 --scope x (unknown scope "x"; use turn, run or detached)"#
                    .into()
            )
        );
    }

    #[test]
    fn step_lines_are_notes_for_the_default_reply() {
        let mut builder = ReplyBuilder::default();
        builder.add(&parse_line("do it"));
        builder.add(&parse_line("!step b 1"));
        builder.note("step b: stp_1 started".into());
        assert_eq!(builder.finish(), vec!["ok: do it", "step b: stp_1 started"]);
    }

    #[test]
    fn default_reply_quotes_first_prose_line() {
        assert_eq!(reply_for("hello world"), vec!["ok: hello world"]);
        assert_eq!(reply_for("\n  second \nthird"), vec!["ok: second"]);
        assert_eq!(reply_for("!sleep 1ms"), vec!["ok"]);
        let long = "x".repeat(100);
        assert_eq!(reply_for(&long), vec![format!("ok: {}", "x".repeat(60))]);
        let wide = "é".repeat(70);
        assert_eq!(reply_for(&wide), vec![format!("ok: {}", "é".repeat(60))]);
    }

    #[test]
    fn explicit_replies_join_and_notes_stay_in_order() {
        assert_eq!(
            reply_for("prose\n!reply one\n!bogus\n!reply two"),
            vec!["one", "unknown directive: !bogus", "two"]
        );
        assert_eq!(
            reply_for("hi\n!bogus"),
            vec!["ok: hi", "unknown directive: !bogus"]
        );
    }

    #[test]
    fn renders_reply_with_indented_continuations() {
        assert_eq!(render_reply(&["a".into()]), "● a\n");
        assert_eq!(render_reply(&["a".into(), "b".into()]), "● a\n  b\n");
        assert_eq!(render_reply(&["a\x1b[2Jb".into()]), "● a[2Jb\n");
        assert_eq!(render_reply(&[]), "● \n");
    }

    #[test]
    fn renders_echo() {
        assert_eq!(render_echo("hello"), "hello\n");
        assert_eq!(render_echo("a\nb\nc"), "a [+2 more lines]\n");
        assert_eq!(render_echo("a\n\nc"), "a [+2 more lines]\n");
    }
}
