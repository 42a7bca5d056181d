//! The arguments of a `!step` directive (name, duration, outcome, `--scope`, `--count`) and
//! the `turnstile step start` command line they become. Pure: the `!step` and `!groups`
//! directives build these, and `step` runs them.

use std::time::Duration;

use turnstile_shared::duration;

/// How the command of a `!step` ends once its sleep is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    /// `sleep SECS`: exits 0.
    Ok,
    /// `sh -c "sleep SECS; exit 1"`: exits 1.
    Fail,
}

/// The `--scope` handed to `turnstile step start`, spelled once (as the CLI spells it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::EnumString, strum::IntoStaticStr)]
#[strum(serialize_all = "lowercase")]
pub enum StepScope {
    Turn,
    /// The CLI's default: outlives the turn until it ends or its session stops.
    Session,
    /// The older name of `session`, passed on as given.
    Run,
    Detached,
}

impl StepScope {
    pub(crate) fn parse(text: &str) -> Option<Self> {
        text.parse().ok()
    }

    /// The value as the CLI spells it.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// The arguments of a `!step` directive.
///
/// Grammar (whitespace-separated tokens): `NAME DURATION [ok|fail]` as positionals in that order,
/// with `--scope turn|session|detached`, `--count N`, `--trace FILE`, `--child DURATION` and
/// `--agent` (or `--scope=S`, ...) anywhere among them.
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
    /// `--trace FILE`: the command first appends its step id (`$TURNSTILE_STEP`) to FILE, so
    /// a checker can count how often each step's command started.
    pub trace: Option<String>,
    /// `--child DURATION`: the command first starts a step of its own (`NAME-child`, sleeping
    /// DURATION, traced like its parent) with the step's credentials: a nested step.
    pub child: Option<Duration>,
    /// `--agent`: a background agent instead of a command. Its prompt has the new agent sleep
    /// DURATION and, with `--trace`, start a traced step of its own (`NAME-sub`).
    pub agent: bool,
}

impl StepSpec {
    /// Parses the text after `!step`; the error is a short reason for the `invalid directive` note.
    pub fn parse(arg: &str) -> Result<Self, String> {
        let mut tokens = arg.split_whitespace();
        let mut positionals = Vec::new();
        let mut scope = None;
        let mut count = None;
        let mut trace = None;
        let mut child = None;
        let mut agent = false;
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
                "agent" if inline.is_none() => {
                    agent = true;
                    continue;
                }
                "scope" | "count" | "trace" | "child" => {}
                _ => return Err(format!("unknown option {token:?}")),
            }
            let value = inline
                .or_else(|| tokens.next())
                .filter(|value| !value.is_empty())
                .ok_or_else(|| format!("--{key} needs a value"))?;
            if key == "child" {
                if child.is_some() {
                    return Err("--child given twice".to_string());
                }
                child = Some(duration::parse(value).map_err(|err| format!("--child: {err}"))?);
            } else if key == "trace" {
                if trace.is_some() {
                    return Err("--trace given twice".to_string());
                }
                if value.contains('\'') {
                    return Err(format!("--trace {value:?} must not contain a quote"));
                }
                trace = Some(value.to_string());
            } else if key == "scope" {
                if scope.is_some() {
                    return Err("--scope given twice".to_string());
                }
                scope = Some(StepScope::parse(value).ok_or_else(|| {
                    format!("unknown scope {value:?}; use turn, session or detached")
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
        let text = positionals.next().ok_or("missing duration")?;
        let duration = duration::parse(text).map_err(|err| err.to_string())?;
        let outcome = match positionals.next() {
            None | Some("ok") => StepOutcome::Ok,
            Some("fail") => StepOutcome::Fail,
            Some(other) => return Err(format!("unknown outcome {other:?}; use ok or fail")),
        };
        if let Some(extra) = positionals.next() {
            return Err(format!("unexpected argument {extra:?}"));
        }
        if agent && (child.is_some() || outcome == StepOutcome::Fail) {
            return Err("--agent takes neither --child nor fail".to_string());
        }
        Ok(Self {
            name: name.to_string(),
            duration,
            outcome,
            scope,
            count,
            trace,
            child,
            agent,
        })
    }

    /// The arguments after the turnstile executable (`exe`, which a nested step's command
    /// calls again): `step start --name NAME [--scope S] [--count N] -- <command>`, or
    /// `... --kind agent --prompt TEXT` for a background agent.
    pub fn cli_args(&self, exe: &str) -> Vec<String> {
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
        let seconds = decimal_seconds(self.duration);
        if self.agent {
            let mut prompt = format!("[background {}]\n!sleep {seconds}", self.name);
            if let Some(trace) = &self.trace {
                prompt.push_str(&format!("\n!step {}-sub 500ms --trace {trace}", self.name));
            }
            args.extend(["--kind".into(), "agent".into(), "--prompt".into(), prompt]);
            return args;
        }
        args.push("--".into());
        if self.trace.is_some() || self.child.is_some() {
            let exit = match self.outcome {
                StepOutcome::Ok => "",
                StepOutcome::Fail => "; exit 1",
            };
            let log = |var: &str| match &self.trace {
                Some(trace) => format!("echo \"{var}TURNSTILE_STEP\" >> '{trace}'; "),
                None => String::new(),
            };
            let child = match self.child {
                Some(d) => format!(
                    "'{exe}' step start --name {}-child -- sh -c \"{}sleep {}\" > /dev/null; ",
                    self.name,
                    log("\\$").replace('"', "\\\""),
                    decimal_seconds(d)
                ),
                None => String::new(),
            };
            args.push("sh".into());
            args.push("-c".into());
            args.push(format!("{}{child}sleep {seconds}{exit}", log("$")));
            return args;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn step(arg: &str) -> StepSpec {
        StepSpec::parse(arg).unwrap_or_else(|err| panic!("{arg:?}: {err}"))
    }

    fn step_error(arg: &str) -> String {
        StepSpec::parse(arg).expect_err(arg)
    }

    fn args(spec: &StepSpec) -> Vec<String> {
        spec.cli_args("turnstile")
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
                trace: None,
                child: None,
                agent: false,
            }
        );
        assert_eq!(
            args(&spec),
            ["step", "start", "--name", "build", "--", "sleep", "2"]
        );
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
    fn a_traced_step_logs_its_id_before_it_sleeps() {
        let spec = step("t 2 fail --trace /tmp/starts.log");
        assert_eq!(spec.trace.as_deref(), Some("/tmp/starts.log"));
        assert_eq!(
            args(&spec)[4..],
            [
                "--",
                "sh",
                "-c",
                "echo \"$TURNSTILE_STEP\" >> '/tmp/starts.log'; sleep 2; exit 1"
            ]
        );
        assert_eq!(
            step_error("t 2 --trace /a'b"),
            r#"--trace "/a'b" must not contain a quote"#
        );
    }

    #[test]
    fn a_nested_step_is_started_by_its_parents_command_with_the_same_cli() {
        let spec = step("p 2 --child 500ms --trace /tmp/s.log");
        assert_eq!(spec.child, Some(Duration::from_millis(500)));
        assert_eq!(
            args(&spec)[4..],
            [
                "--",
                "sh",
                "-c",
                "echo \"$TURNSTILE_STEP\" >> '/tmp/s.log'; 'turnstile' step start --name \
                 p-child -- sh -c \"echo \\\"\\$TURNSTILE_STEP\\\" >> '/tmp/s.log'; sleep 0.5\" \
                 > /dev/null; sleep 2"
            ]
        );
        // Run for real with a stand-in CLI that runs the child's command as step `stp_child`:
        // both shells log their own step id to the trace.
        let dir = std::env::temp_dir().join(format!("mock-nest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cli, trace) = (dir.join("cli"), dir.join("trace"));
        std::fs::write(
            &cli,
            "#!/bin/sh\nwhile [ \"$1\" != -- ]; do shift; done; shift\nTURNSTILE_STEP=stp_child exec \"$@\"\n",
        )
        .unwrap();
        let mut perms = std::fs::metadata(&cli).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&cli, perms).unwrap();
        let spec = step(&format!("p 1ms --child 1ms --trace {}", trace.display()));
        let script = spec.cli_args(&cli.to_string_lossy())[7].clone();
        let status = std::process::Command::new("sh")
            .arg("-c")
            .arg(&script)
            .env("TURNSTILE_STEP", "stp_parent")
            .status()
            .unwrap();
        assert!(status.success(), "{script}");
        assert_eq!(
            std::fs::read_to_string(&trace).unwrap(),
            "stp_parent\nstp_child\n"
        );
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(step("p 1 --child 1s").child, Some(Duration::from_secs(1)));
        assert_eq!(
            args(&step("p 1 --child 1s"))[4..],
            [
                "--",
                "sh",
                "-c",
                "'turnstile' step start --name p-child -- sh -c \"sleep 1\" > /dev/null; sleep 1"
            ]
        );
        assert!(step_error("p 1 --child soon").starts_with("--child: "));
    }

    #[test]
    fn a_background_agent_step_has_a_prompt_and_no_command() {
        let spec = step("bg 1s --agent --trace /tmp/s.log");
        assert!(spec.agent);
        assert_eq!(
            args(&spec),
            [
                "step",
                "start",
                "--name",
                "bg",
                "--kind",
                "agent",
                "--prompt",
                "[background bg]\n!sleep 1\n!step bg-sub 500ms --trace /tmp/s.log"
            ]
        );
        assert_eq!(
            step_error("bg 1s --agent --child 1s"),
            "--agent takes neither --child nor fail"
        );
    }

    #[test]
    fn step_scope_and_count() {
        for (word, scope) in [
            ("turn", StepScope::Turn),
            ("session", StepScope::Session),
            ("run", StepScope::Run),
            ("detached", StepScope::Detached),
        ] {
            let spec = step(&format!("s 1 --scope {word}"));
            assert_eq!(spec.scope, Some(scope));
            assert_eq!(scope.as_str(), word);
            assert_eq!(StepScope::parse(word), Some(scope));
            assert_eq!(StepScope::parse(&word.to_uppercase()), None);
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
        assert!(step_error("build soon").starts_with(r#"invalid duration "soon""#));
        assert!(step_error("build 5x").starts_with(r#"invalid duration "5x""#));
        assert!(step_error("build -1s").starts_with(r#"invalid duration "-1s""#));
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
            step_error("b 1 --scope forever"),
            r#"unknown scope "forever"; use turn, session or detached"#
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
}
