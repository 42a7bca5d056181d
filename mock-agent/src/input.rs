//! Turns raw terminal bytes into submitted messages (line editing, escape sequences, bracketed paste) as a pure state machine.

/// Maximum number of parameter bytes kept for one CSI sequence; longer ones are dropped.
const MAX_CSI_PARAMS: usize = 32;

/// Where the machine is inside an escape sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Escape {
    /// Not inside an escape sequence.
    None,
    /// Just saw ESC.
    Start,
    /// Inside `ESC [`, collecting parameter and intermediate bytes.
    Csi(Vec<u8>),
    /// Inside `ESC O`, waiting for the single final byte.
    Ss3,
}

/// Byte-at-a-time input editor.
///
/// Outside a paste, `\r`/`\n` submit the buffer (when it is not blank), DEL/BS delete the last
/// character and escape sequences are swallowed. `ESC [200~` starts a bracketed paste in which
/// every byte is kept (with `\r` and `\r\n` normalised to `\n`) until `ESC [201~`; a paste never
/// submits on its own.
#[derive(Debug, Clone)]
pub struct InputMachine {
    buffer: Vec<u8>,
    pasting: bool,
    escape: Escape,
    last_was_cr: bool,
}

impl Default for InputMachine {
    fn default() -> Self {
        Self::new()
    }
}

impl InputMachine {
    pub fn new() -> Self {
        Self {
            buffer: Vec::new(),
            pasting: false,
            escape: Escape::None,
            last_was_cr: false,
        }
    }

    /// True while inside a bracketed paste.
    #[cfg(test)]
    pub fn is_pasting(&self) -> bool {
        self.pasting
    }

    /// The bytes typed or pasted so far for the next message.
    #[cfg(test)]
    pub fn pending(&self) -> &[u8] {
        &self.buffer
    }

    /// Feeds a run of bytes and returns every message they submitted, in order.
    #[cfg(test)]
    pub fn feed_all(&mut self, bytes: &[u8]) -> Vec<String> {
        bytes.iter().filter_map(|&byte| self.feed(byte)).collect()
    }

    /// Feeds one byte; returns the message text when this byte submitted one.
    ///
    /// The message is the buffer decoded as UTF-8 (lossily) with leading and trailing line
    /// breaks removed.
    pub fn feed(&mut self, byte: u8) -> Option<String> {
        match std::mem::replace(&mut self.escape, Escape::None) {
            Escape::None => self.plain(byte),
            Escape::Start => {
                self.after_esc(byte);
                None
            }
            Escape::Csi(params) => {
                self.in_csi(params, byte);
                None
            }
            Escape::Ss3 => {
                if self.pasting {
                    self.push_raw(&[0x1b, b'O', byte]);
                }
                None
            }
        }
    }

    fn plain(&mut self, byte: u8) -> Option<String> {
        if byte == 0x1b {
            self.escape = Escape::Start;
            return None;
        }
        if self.pasting {
            self.paste_byte(byte);
            return None;
        }
        self.last_was_cr = false;
        match byte {
            b'\r' | b'\n' => self.submit(),
            0x7f | 0x08 => {
                self.delete_last_char();
                None
            }
            b'\t' => {
                self.buffer.push(byte);
                None
            }
            // Other control bytes (Ctrl-letters) have no meaning here.
            0x00..=0x1f => None,
            _ => {
                self.buffer.push(byte);
                None
            }
        }
    }

    fn paste_byte(&mut self, byte: u8) {
        match byte {
            b'\r' => {
                self.buffer.push(b'\n');
                self.last_was_cr = true;
            }
            b'\n' if self.last_was_cr => self.last_was_cr = false,
            _ => {
                self.buffer.push(byte);
                self.last_was_cr = false;
            }
        }
    }

    fn after_esc(&mut self, byte: u8) {
        match byte {
            b'[' => self.escape = Escape::Csi(Vec::new()),
            b'O' => self.escape = Escape::Ss3,
            0x1b => {
                // A lone ESC followed by another ESC: drop the first, start over with the second.
                if self.pasting {
                    self.push_raw(&[0x1b]);
                }
                self.escape = Escape::Start;
            }
            _ => {
                if self.pasting {
                    self.push_raw(&[0x1b, byte]);
                }
            }
        }
    }

    fn in_csi(&mut self, mut params: Vec<u8>, byte: u8) {
        match byte {
            0x20..=0x3f => {
                // Overlong parameter runs are truncated; the sequence still ends at its final byte.
                if params.len() < MAX_CSI_PARAMS {
                    params.push(byte);
                }
                self.escape = Escape::Csi(params);
            }
            0x40..=0x7e => {
                if byte == b'~' && params == b"200" {
                    self.pasting = true;
                    self.last_was_cr = false;
                } else if byte == b'~' && params == b"201" {
                    self.pasting = false;
                    self.last_was_cr = false;
                } else if self.pasting {
                    self.push_csi(&params, byte);
                }
            }
            _ => {
                // Malformed sequence: outside a paste it is dropped, inside it is kept verbatim.
                if self.pasting {
                    self.push_csi(&params, byte);
                }
            }
        }
    }

    fn push_csi(&mut self, params: &[u8], last: u8) {
        self.push_raw(&[0x1b, b'[']);
        self.push_raw(params);
        self.push_raw(&[last]);
    }

    fn push_raw(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
        self.last_was_cr = false;
    }

    fn delete_last_char(&mut self) {
        // Drop UTF-8 continuation bytes, then the lead byte of the last character.
        while let Some(&last) = self.buffer.last() {
            self.buffer.pop();
            if last & 0b1100_0000 != 0b1000_0000 {
                break;
            }
        }
    }

    fn submit(&mut self) -> Option<String> {
        let bytes = std::mem::take(&mut self.buffer);
        let text = String::from_utf8_lossy(&bytes);
        if text.trim().is_empty() {
            return None;
        }
        Some(text.trim_matches(['\n', '\r']).to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(bytes: &[u8]) -> Vec<String> {
        InputMachine::new().feed_all(bytes)
    }

    #[test]
    fn typed_line_submits_on_enter() {
        assert_eq!(run(b"hello\r"), vec!["hello"]);
        assert_eq!(run(b"hello\n"), vec!["hello"]);
        assert_eq!(run(b"one\rtwo\r"), vec!["one", "two"]);
    }

    #[test]
    fn blank_enter_is_ignored() {
        assert!(run(b"\r\r   \r\t\n").is_empty());
        assert_eq!(run(b"  \rhi\r"), vec!["hi"]);
    }

    #[test]
    fn backspace_deletes_whole_utf8_chars() {
        assert_eq!(run(b"abc\x7f\x7fd\r"), vec!["ad"]);
        assert_eq!(run("héé\x7f\r".as_bytes()), vec!["hé"]);
        assert_eq!(run("❯x\x08\x08y\r".as_bytes()), vec!["y"]);
        assert_eq!(run(b"\x7f\x7fok\r"), vec!["ok"]);
    }

    #[test]
    fn utf8_survives_and_invalid_bytes_are_replaced() {
        assert_eq!(run("héllo ❯ 🦀\r".as_bytes()), vec!["héllo ❯ 🦀"]);
        assert_eq!(run(b"a\xffb\r"), vec!["a\u{fffd}b"]);
    }

    #[test]
    fn escape_sequences_are_ignored_outside_paste() {
        // Arrow keys (CSI and SS3 forms), a modified key, and alt+x.
        assert_eq!(run(b"a\x1b[A\x1b[1;5C\x1bOBb\x1bxc\x1b[15~\r"), vec!["abc"]);
    }

    #[test]
    fn paste_is_kept_and_needs_enter() {
        let mut m = InputMachine::new();
        assert!(m
            .feed_all(b"\x1b[200~line one\rline two\r\x1b[201~")
            .is_empty());
        assert!(!m.is_pasting());
        assert_eq!(m.pending(), b"line one\nline two\n");
        assert_eq!(m.feed_all(b"\r"), vec!["line one\nline two"]);
    }

    #[test]
    fn paste_normalises_crlf_and_keeps_blank_lines() {
        assert_eq!(
            run(b"\x1b[200~a\r\nb\n\nc\r\r\x1b[201~\r"),
            vec!["a\nb\n\nc"]
        );
    }

    #[test]
    fn paste_keeps_control_bytes_and_foreign_escapes() {
        assert_eq!(
            run(b"\x1b[200~x\x7fy\x1b[31mz\x1b[201~\r"),
            vec!["x\u{7f}y\u{1b}[31mz"]
        );
    }

    #[test]
    fn paste_appends_to_typed_text() {
        assert_eq!(
            run(b"say: \x1b[200~hello\nworld\x1b[201~!\r"),
            vec!["say: hello\nworld!"]
        );
    }

    #[test]
    fn paste_split_across_feeds() {
        let mut m = InputMachine::new();
        let mut out = Vec::new();
        for chunk in [
            &b"\x1b["[..],
            b"20",
            b"0~ab",
            b"\r\x1b",
            b"[201",
            b"~",
            b"\r",
        ] {
            out.extend(m.feed_all(chunk));
        }
        assert_eq!(out, vec!["ab"]);
    }

    #[test]
    fn multibyte_chars_in_paste() {
        assert_eq!(run("\x1b[200~ünï\r✓\x1b[201~\r".as_bytes()), vec!["ünï\n✓"]);
    }

    #[test]
    fn overlong_csi_does_not_grow_without_bound() {
        let mut bytes = b"\x1b[".to_vec();
        bytes.extend(std::iter::repeat_n(b'1', 1000));
        bytes.extend_from_slice(b"~ok\r");
        assert_eq!(run(&bytes), vec!["ok"]);
    }
}
