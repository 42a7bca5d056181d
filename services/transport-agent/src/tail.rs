//! The last lines a process wrote: kept while it runs, read once it has ended, as the result of
//! a step or the evidence of a crash. One reader task per stream; `lines` waits for the readers
//! to reach the end, so a process that just exited never reports an empty tail.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::task::JoinHandle;

pub struct Tail {
    lines: Arc<Mutex<VecDeque<String>>>,
    readers: Vec<JoinHandle<()>>,
    keep: usize,
}

impl Tail {
    pub fn new(keep: usize) -> Self {
        Self {
            lines: Arc::new(Mutex::new(VecDeque::with_capacity(keep))),
            readers: Vec::new(),
            keep,
        }
    }

    /// Starts reading one stream into the tail (stdout and stderr may share it).
    pub fn follow(&mut self, stream: impl AsyncRead + Unpin + Send + 'static) {
        let lines = self.lines.clone();
        let keep = self.keep;
        self.readers.push(tokio::spawn(async move {
            let mut reader = BufReader::new(stream).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                if let Ok(mut t) = lines.lock() {
                    if t.len() == keep {
                        t.pop_front();
                    }
                    t.push_back(line.chars().take(500).collect());
                }
            }
        }));
    }

    /// The kept lines, after the readers have reached the end of their streams (bounded: a
    /// grandchild holding a pipe open cannot hold this up for more than a second).
    pub async fn lines(&mut self) -> Vec<String> {
        for r in self.readers.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(1), r).await;
        }
        self.lines
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// How a child that has ended (or is ending) exited, for evidence: `exit status: 3`, a signal,
/// or `unknown` if it does not end within two seconds.
pub async fn exit_status(child: &mut tokio::process::Child) -> String {
    tokio::time::timeout(Duration::from_secs(2), child.wait())
        .await
        .ok()
        .and_then(|s| s.ok())
        .map_or("unknown".to_string(), |s| s.to_string())
}
