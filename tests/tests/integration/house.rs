//! The house rules, checked on the checkout itself so they stay true: every rule in
//! `docs/rules.md` names tests that exist, no doc points outside the repository, no code
//! matches an API error code or spells an event kind outside its registry, and no source file
//! grows past 600 lines. No NATS needed.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use strum::VariantNames;
use turnstile_shared::api::ErrorCode;
use turnstile_shared::events::EventKind;

/// The crates whose code the vocabulary and size rules cover (test code may spell anything).
const CODE: [&str; 5] = ["shared", "services", "cli", "mock-agent", "bench"];
/// Where a registry spells its vocabulary (and so may).
const REGISTRIES: [&str; 2] = ["shared/src/events.rs", "shared/src/api.rs"];
const MAX_LINES: usize = 600;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// Each code file with its text up to its unit-test module (tests may spell anything).
fn code_files() -> Result<Vec<(String, String)>> {
    let root = root();
    let mut files = Vec::new();
    for dir in CODE {
        rust_files(&root.join(dir), &mut files)?;
    }
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p)?;
            let code = text
                .split("#[cfg(test)]")
                .next()
                .unwrap_or_default()
                .to_string();
            let rel = p.strip_prefix(&root).unwrap_or(&p).display().to_string();
            Ok((rel, code))
        })
        .collect()
}

/// The body of `## Rn …` up to the next `## ` heading.
fn rule_section(rules: &str, n: usize) -> Option<&str> {
    let start = rules.find(&format!("\n## R{n} "))? + 1;
    let rest = &rules[start..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |i| i + 3);
    Some(&rest[..end])
}

/// `file.rs::function` (integration) or `path/to/file.rs::function` (unit) names in a text.
fn named_tests(text: &str) -> Vec<(String, String)> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|quoted| {
            let (file, func) = quoted.split_once(".rs::")?;
            let func: String = func
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            (!func.is_empty()).then(|| (format!("{file}.rs"), func))
        })
        .collect()
}

#[test]
fn every_rule_names_tests_that_exist() -> Result<()> {
    let root = root();
    let rules = std::fs::read_to_string(root.join("docs/rules.md")).context("docs/rules.md")?;
    for n in 1..=15 {
        let section = rule_section(&rules, n).with_context(|| format!("no section for R{n}"))?;
        let tests_part = section
            .split("**Tests.**")
            .nth(1)
            .with_context(|| format!("R{n} has no **Tests.** part"))?;
        let tests = named_tests(tests_part);
        ensure!(!tests.is_empty(), "R{n} names no test");
        for (file, func) in tests {
            let path = if file.contains('/') {
                root.join(&file)
            } else {
                root.join("tests/tests/integration").join(&file)
            };
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("R{n} names {file}, which does not exist"))?;
            ensure!(
                text.contains(&format!("fn {func}(")),
                "R{n} names {file}::{func}, which does not exist"
            );
        }
        // Every code path a mechanism names exists.
        for quoted in section.split('`').skip(1).step_by(2) {
            if quoted.ends_with(".rs") && quoted.contains('/') && !quoted.contains("::") {
                ensure!(
                    root.join(quoted).exists(),
                    "R{n} names {quoted}, which does not exist"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn docs_point_only_inside_the_repository() -> Result<()> {
    let root = root();
    let mut docs = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs"))? {
        docs.push(entry?.path());
    }
    for doc in docs
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
    {
        let text = std::fs::read_to_string(doc)?;
        for outside in ["design.md", "../shared", "seeds/", "design brief"] {
            ensure!(
                !text.contains(outside),
                "{} points outside the repository ({outside:?}); rules live in docs/rules.md",
                doc.display()
            );
        }
    }
    Ok(())
}

#[test]
fn codes_and_kinds_are_spelled_only_in_their_registries() -> Result<()> {
    let kinds: Vec<String> = EventKind::all().map(|k| format!("\"{k}\"")).collect();
    let codes: Vec<&str> = ErrorCode::VARIANTS
        .iter()
        .copied()
        .filter(|c| *c != "other")
        .collect();
    let mut found = Vec::new();
    for (file, code) in code_files()? {
        if REGISTRIES.contains(&file.as_str()) {
            continue;
        }
        for (i, line) in code.lines().enumerate() {
            // A named constant in a registry module of another protocol (e.g. Codex's own
            // line types) is a registry entry, not a spelling at a use site.
            if line.trim_start().starts_with("pub const ") {
                continue;
            }
            for kind in kinds.iter().filter(|k| line.contains(k.as_str())) {
                found.push(format!("{file}:{}: event kind {kind}", i + 1));
            }
            let matches_code = line.contains("ApiError::new(\"")
                || line.contains("code == \"")
                || line.contains("code.as_str()")
                || (line.contains("code")
                    && codes.iter().any(|c| line.contains(&format!("\"{c}\""))));
            if matches_code {
                found.push(format!("{file}:{}: error code by string", i + 1));
            }
        }
    }
    ensure!(
        found.is_empty(),
        "vocabulary outside its registry:\n{}",
        found.join("\n")
    );
    Ok(())
}

#[test]
fn no_source_file_grows_past_the_limit() -> Result<()> {
    let long: Vec<String> = code_files()?
        .into_iter()
        .map(|(file, code)| (file, code.lines().count()))
        .filter(|(_, n)| *n > MAX_LINES)
        .map(|(file, n)| format!("{file}: {n} lines"))
        .collect();
    ensure!(
        long.is_empty(),
        "files over {MAX_LINES} lines (split them):\n{}",
        long.join("\n")
    );
    Ok(())
}
