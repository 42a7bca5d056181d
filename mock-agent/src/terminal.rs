//! Puts the controlling terminal into raw-ish mode with bracketed paste for the agent's lifetime and restores it afterwards.

use std::io::{self, IsTerminal, Write};
use std::process::{Command, Stdio};

const PASTE_ON: &[u8] = b"\x1b[?2004h";
const PASTE_OFF: &[u8] = b"\x1b[?2004l";

/// Restores the terminal (`stty sane`, bracketed paste off) when dropped.
#[derive(Debug)]
pub struct TerminalGuard {
    stty_changed: bool,
    paste_enabled: bool,
}

impl TerminalGuard {
    /// Best effort: `stty -echo -icanon min 1` when stdin is a terminal, and bracketed paste
    /// when stdout is one. Failures leave the terminal as it was (input is then line-buffered).
    pub fn engage() -> Self {
        let stty_changed = io::stdin().is_terminal() && stty(&["-echo", "-icanon", "min", "1"]);
        let paste_enabled = io::stdout().is_terminal() && write_flush(PASTE_ON);
        Self {
            stty_changed,
            paste_enabled,
        }
    }
}

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        if self.paste_enabled {
            write_flush(PASTE_OFF);
        }
        if self.stty_changed {
            stty(&["sane"]);
        }
    }
}

/// Runs `stty` on the inherited stdin; true when it succeeded.
fn stty(args: &[&str]) -> bool {
    Command::new("stty")
        .args(args)
        .stdin(Stdio::inherit())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

fn write_flush(bytes: &[u8]) -> bool {
    let mut out = io::stdout();
    out.write_all(bytes).and_then(|()| out.flush()).is_ok()
}
