//! What a session's agent may do without asking. Turnstile runs agents unattended: nothing
//! may wait for an approval that nobody will give. So a session states up front what its
//! agent may do (`session create --allow`), each adapter maps that onto its CLI's own flags
//! and config, and a tool call outside it is refused by the CLI at once; the refusal fails
//! the turn (`permission_denied`, with what was refused) instead of passing as a success.
//! The Turnstile MCP tools are always allowed.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A session's permission policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Create and edit files (in the session's directory, as each CLI bounds it).
    #[serde(default)]
    pub edits: bool,
    /// Run shell commands.
    #[serde(default)]
    pub shell: bool,
    /// Reach the network from tools (web fetch and search; network inside sandboxed commands).
    #[serde(default)]
    pub network: bool,
    /// More of the CLI's own allow rules, passed on as written (Claude: `--allowedTools`
    /// entries such as `Bash(git *)` or `mcp__github`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
}

impl Default for Policy {
    /// What coding agents are run for: edit files and run commands in their directory; no
    /// network.
    fn default() -> Self {
        Self {
            edits: true,
            shell: true,
            network: false,
            tools: Vec::new(),
        }
    }
}

impl Policy {
    /// Nothing but reading and the Turnstile tools.
    pub fn none() -> Self {
        Self {
            edits: false,
            shell: false,
            network: false,
            tools: Vec::new(),
        }
    }
}

/// The capabilities `--allow` names, spelled once.
const CAPABILITIES: &str = "edits, shell, network, all or none";

/// Parses `--allow`: a comma-separated list of `edits`, `shell`, `network`, or `all` / `none`.
impl FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut p = Policy::none();
        for word in s.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            match word {
                "edits" => p.edits = true,
                "shell" => p.shell = true,
                "network" => p.network = true,
                "all" => {
                    p.edits = true;
                    p.shell = true;
                    p.network = true;
                }
                "none" => {}
                other => return Err(format!("unknown capability {other:?}; use {CAPABILITIES}")),
            }
        }
        Ok(p)
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let words: Vec<&str> = [
            (self.edits, "edits"),
            (self.shell, "shell"),
            (self.network, "network"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, w)| *w)
        .collect();
        if words.is_empty() {
            f.write_str("none")?;
        } else {
            f.write_str(&words.join(","))?;
        }
        for t in &self.tools {
            write!(f, " +{t}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_lists_parse_and_print_back() {
        let p: Policy = "shell, edits".parse().expect("parse");
        assert!(p.shell && p.edits && !p.network);
        assert_eq!(p.to_string(), "edits,shell");
        assert_eq!("none".parse::<Policy>().expect("none"), Policy::none());
        assert_eq!(
            "all".parse::<Policy>().expect("all").to_string(),
            "edits,shell,network"
        );
        let e = "shell,root".parse::<Policy>().expect_err("unknown");
        assert!(e.contains("\"root\"") && e.contains("edits, shell"), "{e}");
    }

    #[test]
    fn a_record_without_a_policy_field_reads_as_nothing_set() {
        let p: Policy = serde_json::from_str("{}").expect("empty");
        assert_eq!(p, Policy::none());
    }
}
