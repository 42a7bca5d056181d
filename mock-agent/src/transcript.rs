//! Durable JSONL transcript of submitted messages, one file per conversation, so tests can check delivery and `--resume` can count history.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use chrono::{SecondsFormat, Utc};

/// Append-only handle on `<state_dir>/<conversation-id>.jsonl`.
#[derive(Debug)]
pub struct Transcript {
    path: PathBuf,
    file: File,
}

/// The transcript path for a conversation.
pub fn transcript_path(state_dir: &Path, conversation: &str) -> PathBuf {
    state_dir.join(format!("{conversation}.jsonl"))
}

/// Number of non-blank lines (messages) in a transcript; a missing file has none.
pub fn count_messages(path: &Path) -> Result<usize> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == ErrorKind::NotFound => return Ok(0),
        Err(err) => {
            return Err(err).with_context(|| format!("opening transcript {}", path.display()))
        }
    };
    let mut count = 0;
    for line in BufReader::new(file).lines() {
        let line = line.with_context(|| format!("reading transcript {}", path.display()))?;
        if !line.trim().is_empty() {
            count += 1;
        }
    }
    Ok(count)
}

impl Transcript {
    /// Opens (creating if needed) the transcript for `conversation` in append mode.
    pub fn open(state_dir: &Path, conversation: &str) -> Result<Self> {
        let path = transcript_path(state_dir, conversation);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening transcript {}", path.display()))?;
        Ok(Self { path, file })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one `{"at", "conversation", "message"}` line and syncs it to disk.
    pub fn append(&mut self, conversation: &str, message: &str) -> Result<()> {
        let record = serde_json::json!({
            "at": Utc::now().to_rfc3339_opts(SecondsFormat::Millis, true),
            "conversation": conversation,
            "message": message,
        });
        let mut line = serde_json::to_vec(&record).context("encoding transcript record")?;
        line.push(b'\n');
        self.file
            .write_all(&line)
            .and_then(|()| self.file.flush())
            .and_then(|()| self.file.sync_data())
            .with_context(|| format!("writing transcript {}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "turnstile-mock-agent-{tag}-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn appends_json_lines_and_counts_them() {
        let dir = temp_dir("transcript");
        let path = transcript_path(&dir, "cnv_x");
        assert_eq!(count_messages(&path).unwrap(), 0);

        let mut t = Transcript::open(&dir, "cnv_x").unwrap();
        assert_eq!(t.path(), path);
        t.append("cnv_x", "hello\nworld").unwrap();
        t.append("cnv_x", "again").unwrap();
        drop(t);
        assert_eq!(count_messages(&path).unwrap(), 2);

        let text = std::fs::read_to_string(&path).unwrap();
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(first["conversation"], "cnv_x");
        assert_eq!(first["message"], "hello\nworld");
        let at = first["at"].as_str().unwrap();
        assert!(chrono::DateTime::parse_from_rfc3339(at).is_ok(), "{at}");
        assert!(at.ends_with('Z') && at.contains('.'), "{at}");

        // Reopening appends rather than truncating.
        Transcript::open(&dir, "cnv_x")
            .unwrap()
            .append("cnv_x", "third")
            .unwrap();
        assert_eq!(count_messages(&path).unwrap(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
