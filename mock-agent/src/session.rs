//! The conversation loop: reads input, echoes and records each message, acts on its directives and prints the reply and prompt.

use std::io::{ErrorKind, Read, Write};

use anyhow::{Context, Result};

use crate::directives::{parse_line, render_echo, render_reply, Line, ReplyBuilder};
use crate::input::InputMachine;
use crate::spinner::spin;
use crate::step;
use crate::transcript::Transcript;

/// The ready prompt. A screen whose cursor line is exactly this means "idle, send the next message".
pub const PROMPT: &str = "❯ ";

/// What to do after a message has been handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Continue,
    Exit(i32),
}

/// One conversation writing to `out` and recording to a transcript.
pub struct Session<W: Write> {
    out: W,
    transcript: Transcript,
    conversation: String,
}

impl<W: Write> Session<W> {
    pub fn new(out: W, transcript: Transcript, conversation: String) -> Self {
        Self {
            out,
            transcript,
            conversation,
        }
    }

    /// Prints the banner and the first prompt; `resumed` is the earlier message count for a resume.
    pub fn banner(&mut self, resumed: Option<usize>) -> Result<()> {
        self.put("Turnstile mock agent\n")?;
        let line = match resumed {
            Some(count) => format!(
                "conversation: {} (resumed, {count} earlier messages)\n",
                self.conversation
            ),
            None => format!("conversation: {}\n", self.conversation),
        };
        self.put(&line)?;
        self.put(PROMPT)
    }

    /// Handles one submitted message: echo, transcript, directives, reply, prompt.
    pub fn handle(&mut self, message: &str) -> Result<Outcome> {
        self.put(&render_echo(message))?;
        self.transcript
            .append(&self.conversation, message)
            .context("recording message")?;
        if let Some(think) = think_time() {
            spin(&mut self.out, Some(think))?;
        }
        let mut reply = ReplyBuilder::default();
        // A hand-over of results moves a `!groups` plan on by one group.
        if crate::groups::is_handover(message) {
            for text in self.next_group() {
                reply.note(text);
            }
        }
        for text in message.lines() {
            let line = parse_line(text);
            match &line {
                Line::Sleep(duration) => spin(&mut self.out, Some(*duration))?,
                Line::Exit(code) => return Ok(Outcome::Exit(*code)),
                Line::Hang => {
                    // Only returns if the terminal goes away.
                    spin(&mut self.out, None)?;
                }
                Line::Groups(plan) => {
                    let mut plan = plan.clone();
                    for text in self.start_group(&mut plan) {
                        reply.note(text);
                    }
                }
                Line::Step(spec) => {
                    for text in step::start(spec) {
                        reply.note(text);
                    }
                }
                Line::Reply(_) | Line::Note(_) | Line::Prose(_) => {}
            }
            reply.add(&line);
        }
        self.put(&render_reply(&reply.finish()))?;
        self.put(PROMPT)?;
        Ok(Outcome::Continue)
    }

    /// Starts the plan's next group (if any) and keeps the plan beside the transcript.
    fn start_group(&mut self, plan: &mut crate::groups::Plan) -> Vec<String> {
        let Some(spec) = plan.next_step() else {
            return vec!["all groups started".to_string()];
        };
        let path = crate::groups::Plan::path(self.transcript.path());
        let mut lines = step::start(&spec);
        if let Err(e) = plan.save(&path) {
            lines.push(format!("could not save the plan: {e}"));
        }
        lines
    }

    fn next_group(&mut self) -> Vec<String> {
        let path = crate::groups::Plan::path(self.transcript.path());
        match crate::groups::Plan::load(&path) {
            Some(mut plan) => self.start_group(&mut plan),
            None => Vec::new(),
        }
    }

    fn put(&mut self, text: &str) -> Result<()> {
        self.out
            .write_all(text.as_bytes())
            .and_then(|()| self.out.flush())
            .context("writing to the terminal")
    }
}

/// Feeds `input` to the session until EOF (exit code 0) or an `!exit` directive (its code).
pub fn drive<R: Read, W: Write>(session: &mut Session<W>, input: R) -> Result<i32> {
    let mut input = input;
    let mut editor = InputMachine::new();
    let mut chunk = [0u8; 4096];
    loop {
        let count = match input.read(&mut chunk) {
            Ok(0) => return Ok(0),
            Ok(count) => count,
            Err(err) if err.kind() == ErrorKind::Interrupted => continue,
            Err(err) => return Err(err).context("reading stdin"),
        };
        for &byte in &chunk[..count] {
            if let Some(message) = editor.feed(byte) {
                if let Outcome::Exit(code) = session.handle(&message)? {
                    return Ok(code);
                }
            }
        }
    }
}

/// Extra time spent on every message, from `TURNSTILE_MOCK_THINK` (e.g. `500ms`): lets fault
/// tests act while any turn, deliveries included, is still running.
fn think_time() -> Option<std::time::Duration> {
    let v = std::env::var("TURNSTILE_MOCK_THINK").ok()?;
    turnstile_shared::duration::parse(v.trim()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transcript::{count_messages, transcript_path};
    use std::path::PathBuf;

    fn temp_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "turnstile-mock-agent-session-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn session_run(dir: &std::path::Path, input: &[u8]) -> (i32, String) {
        let transcript = Transcript::open(dir, "cnv_t").unwrap();
        let mut out = Vec::new();
        let mut session = Session::new(&mut out, transcript, "cnv_t".into());
        session.banner(None).unwrap();
        let code = drive(&mut session, input).unwrap();
        drop(session);
        (code, String::from_utf8(out).unwrap())
    }

    #[test]
    fn conversation_round_trip() {
        let dir = temp_dir();
        let (code, screen) = session_run(
            &dir,
            b"hello\r\x1b[200~!sleep 150ms\r!reply one\r!reply two\r\x1b[201~\r",
        );
        assert_eq!(code, 0);
        assert!(screen.starts_with("Turnstile mock agent\nconversation: cnv_t\n❯ hello\n● ok: hello\n❯ !sleep 150ms [+2 more lines]\n"), "{screen:?}");
        assert!(screen.contains("\r⠋ working… (0s)"), "{screen:?}");
        assert!(screen.ends_with("\r\x1b[2K● one\n  two\n❯ "), "{screen:?}");

        let path = transcript_path(&dir, "cnv_t");
        let text = std::fs::read_to_string(&path).unwrap();
        let messages: Vec<String> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["message"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(
            messages,
            vec!["hello", "!sleep 150ms\n!reply one\n!reply two"]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn exit_directive_stops_without_prompt() {
        let dir = temp_dir();
        let (code, screen) = session_run(&dir, b"bye\r!exit 3\rnever\r");
        assert_eq!(code, 3);
        assert!(screen.ends_with("❯ !exit 3\n"), "{screen:?}");
        assert_eq!(count_messages(&transcript_path(&dir, "cnv_t")).unwrap(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unknown_directive_is_reported() {
        let dir = temp_dir();
        let (code, screen) = session_run(&dir, b"!what\r");
        assert_eq!(code, 0);
        assert!(
            screen.ends_with("❯ !what\n● ok\n  unknown directive: !what\n❯ "),
            "{screen:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn invalid_step_is_a_note_under_the_default_reply() {
        let dir = temp_dir();
        let (code, screen) = session_run(&dir, b"\x1b[200~go\r!step build soon\x1b[201~\r");
        assert_eq!(code, 0);
        // The reason after the duration is the shared duration grammar's own wording.
        let note = "● ok: go\n  invalid directive: !step build soon (invalid duration \"soon\": ";
        assert!(
            screen.contains(note) && screen.ends_with(")\n❯ "),
            "{screen:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
