//! Draws the "working…" spinner line shown while the fake agent is busy (`!sleep`, `!hang`).

use std::io::Write;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Braille frames, advanced every [`FRAME_INTERVAL`].
const FRAMES: [&str; 10] = ["⠋", "⠙", "⠹", "⠸", "⠼", "⠴", "⠦", "⠧", "⠇", "⠏"];
const FRAME_INTERVAL: Duration = Duration::from_millis(100);

/// Shows the spinner for `limit` (forever when `None`), then clears its line.
///
/// The line is always rewritten from column 0 and never contains the prompt glyph, so a
/// controller watching the screen cannot mistake a busy agent for a ready one.
pub fn spin<W: Write>(out: &mut W, limit: Option<Duration>) -> Result<()> {
    let start = Instant::now();
    let mut frame = 0usize;
    loop {
        let elapsed = start.elapsed();
        let remaining = match limit {
            Some(limit) if elapsed >= limit => break,
            Some(limit) => Some(limit - elapsed),
            None => None,
        };
        write!(
            out,
            "\r{} working… ({}s)",
            FRAMES[frame % FRAMES.len()],
            elapsed.as_secs()
        )
        .and_then(|()| out.flush())
        .context("drawing spinner")?;
        frame = frame.wrapping_add(1);
        let nap = remaining.map_or(FRAME_INTERVAL, |r| r.min(FRAME_INTERVAL));
        thread::sleep(nap);
    }
    out.write_all(b"\r\x1b[2K")
        .and_then(|()| out.flush())
        .context("clearing spinner")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_for_the_limit_then_clears() {
        let mut out = Vec::new();
        let start = Instant::now();
        spin(&mut out, Some(Duration::from_millis(250))).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(250));
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("\r⠋ working… (0s)"), "{text:?}");
        assert!(text.contains("\r⠙ working… (0s)"), "{text:?}");
        assert!(text.ends_with("\r\x1b[2K"), "{text:?}");
        assert!(!text.contains('❯'));
    }

    #[test]
    fn zero_limit_only_clears() {
        let mut out = Vec::new();
        spin(&mut out, Some(Duration::ZERO)).unwrap();
        assert_eq!(out, b"\r\x1b[2K");
    }
}
