//! `!groups N DURATION [--scope S]`: a scripted agent that works through N groups one per
//! turn, the way seed 004's agent was asked to: it starts a step for group 1 and ends its turn;
//! each time a hand-over of results arrives (a message starting with `[turnstile]`) it starts
//! the next group's step, until all N are started; the hand-over after the last starts nothing.

use std::path::{Path, PathBuf};
use std::time::Duration;

use turnstile_shared::duration;

use crate::step_spec::{StepOutcome, StepScope, StepSpec};

/// The plan kept beside the transcript, so a resumed conversation goes on with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub total: u32,
    pub started: u32,
    pub duration: Duration,
    pub scope: StepScope,
}

impl Plan {
    /// Parses the text after `!groups`.
    pub fn parse(arg: &str) -> Result<Self, String> {
        let mut tokens = arg.split_whitespace();
        let total: u32 = tokens
            .next()
            .ok_or("missing group count")?
            .parse()
            .map_err(|e| format!("group count: {e}"))?;
        if total == 0 {
            return Err("group count must be at least 1".into());
        }
        let duration = duration::parse(tokens.next().ok_or("missing duration")?)
            .map_err(|e| format!("duration: {e}"))?;
        let scope = match (tokens.next(), tokens.next()) {
            (None, _) => StepScope::Session,
            (Some("--scope"), Some(s)) => StepScope::parse(s).ok_or(format!("bad scope {s:?}"))?,
            (Some(other), _) => return Err(format!("unexpected {other:?}")),
        };
        Ok(Self {
            total,
            started: 0,
            duration,
            scope,
        })
    }

    /// The next group's step, if any is left; counts it as started.
    pub fn next_step(&mut self) -> Option<StepSpec> {
        if self.started >= self.total {
            return None;
        }
        self.started += 1;
        Some(StepSpec {
            name: format!("group-{}", self.started),
            duration: self.duration,
            outcome: StepOutcome::Ok,
            scope: Some(self.scope),
            count: None,
            trace: None,
            child: None,
            agent: false,
        })
    }

    pub fn path(transcript: &Path) -> PathBuf {
        transcript.with_extension("plan")
    }

    pub fn load(path: &Path) -> Option<Self> {
        let text = std::fs::read_to_string(path).ok()?;
        let mut f = text.split_whitespace();
        Some(Self {
            total: f.next()?.parse().ok()?,
            started: f.next()?.parse().ok()?,
            duration: Duration::from_millis(f.next()?.parse().ok()?),
            scope: StepScope::parse(f.next()?)?,
        })
    }

    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(
            path,
            format!(
                "{} {} {} {}\n",
                self.total,
                self.started,
                self.duration.as_millis(),
                self.scope.as_str()
            ),
        )
    }
}

/// A hand-over of results, as Turnstile types it.
pub fn is_handover(message: &str) -> bool {
    message.starts_with("[turnstile]")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_starts_each_group_once_and_persists() {
        let mut p = Plan::parse("3 500ms").expect("plan");
        assert_eq!(p.scope, StepScope::Session);
        let names: Vec<String> = std::iter::from_fn(|| p.next_step().map(|s| s.name)).collect();
        assert_eq!(names, ["group-1", "group-2", "group-3"]);
        assert!(p.next_step().is_none());
        let dir = std::env::temp_dir().join(format!("mock-plan-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = Plan::path(&dir.join("c.jsonl"));
        p.save(&path).expect("save");
        assert_eq!(Plan::load(&path), Some(p));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(Plan::parse("0 1s").is_err());
        assert!(Plan::parse("2").is_err());
        assert_eq!(
            Plan::parse("2 1s --scope turn").map(|p| p.scope),
            Ok(StepScope::Turn)
        );
        assert!(is_handover("[turnstile] 1 background execution finished:"));
    }
}
