//! Interprets the lines of a submitted message (`!sleep`, `!reply`, `!exit`, `!hang`, `!step`,
//! `!groups`, prose) and builds the reply text, without doing any IO.

use std::time::Duration;

use turnstile_shared::duration;

use crate::groups::Plan;
use crate::step_spec::StepSpec;

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
    Groups(Plan),
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
        "sleep" => match duration::parse(arg) {
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
        "groups" => match Plan::parse(arg) {
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

    #[test]
    fn a_step_line_is_parsed_by_step_spec() {
        assert_eq!(
            parse_line("  !step build 2s  "),
            Line::Step(StepSpec::parse("build 2s").expect("spec"))
        );
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
                r#"invalid directive: !step b 1 --scope x (unknown scope "x"; use turn, session or detached)"#
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
