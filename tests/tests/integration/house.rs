//! The house rules, checked on the checkout itself so they stay true: every rule in
//! `docs/rules.md` names tests that exist, no doc points outside the repository, every link
//! of the docs resolves and the README stays a short guide, no code
//! matches an API error code or spells an event kind outside its registry, no source file
//! grows past 600 lines, and no two files of a crate import each other, even through others
//! (`house/imports.rs` finds the cycles). No NATS needed.

mod imports;

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use strum::VariantNames;
use turnstile_shared::api::ErrorCode;
use turnstile_shared::events::EventKind;

/// The crates whose code the vocabulary and size rules cover (test code may spell anything).
const CODE: [&str; 5] = ["shared", "services", "cli", "mock-agent", "bench"];
/// Where a registry spells its vocabulary (and so may).
const REGISTRIES: [&str; 2] = ["shared/src/events.rs", "shared/src/api.rs"];
const MAX_LINES: usize = 500;

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

/// The README is a guide, not a diary: measurements go to `docs/bench-history.jsonl`.
const README_MAX_LINES: usize = 250;

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a markdown file's headings (outside code blocks).
fn anchors(text: &str) -> Vec<String> {
    let mut in_code = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        } else if !in_code && line.starts_with('#') {
            out.push(slug(line.trim_start_matches('#')));
        }
    }
    out
}

#[test]
fn the_readme_is_a_short_guide_and_every_doc_link_resolves() -> Result<()> {
    let root = root();
    let readme = std::fs::read_to_string(root.join("README.md")).context("README.md")?;
    let lines = readme.lines().count();
    ensure!(
        lines < README_MAX_LINES,
        "README.md has {lines} lines (under {README_MAX_LINES}: measurements go to docs/bench-history.jsonl, method to docs/benchmarks.md)"
    );
    let mut docs = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs"))? {
        docs.push(entry?.path());
    }
    let mut broken = Vec::new();
    for doc in docs
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
    {
        let text = std::fs::read_to_string(doc)?;
        let dir = doc.parent().unwrap_or(&root);
        for link in text.split("](").skip(1) {
            let target = link.split([')', ' ', '\n']).next().unwrap_or_default();
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
            let file = if path.is_empty() {
                doc.clone()
            } else {
                dir.join(path)
            };
            let shown = doc.strip_prefix(&root).unwrap_or(doc).display();
            if !file.exists() {
                broken.push(format!("{shown}: {target} (no such file)"));
            } else if !anchor.is_empty() && file.extension().is_some_and(|e| e == "md") {
                let text = std::fs::read_to_string(&file)?;
                if !anchors(&text).iter().any(|a| a == anchor) {
                    broken.push(format!("{shown}: {target} (no such heading)"));
                }
            }
        }
    }
    ensure!(
        broken.is_empty(),
        "links that do not resolve:\n{}",
        broken.join("\n")
    );
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

/// Every crate of the workspace: a directory with a `Cargo.toml` and a `src/`.
fn crate_dirs(root: &Path) -> Result<Vec<PathBuf>> {
    let mut dirs = Vec::new();
    for parent in [root.to_path_buf(), root.join("services")] {
        for entry in
            std::fs::read_dir(&parent).with_context(|| format!("read {}", parent.display()))?
        {
            let dir = entry?.path();
            if dir.join("Cargo.toml").is_file() && dir.join("src").is_dir() {
                dirs.push(dir);
            }
        }
    }
    dirs.sort();
    Ok(dirs)
}

#[test]
fn no_import_cycles_between_files() -> Result<()> {
    let root = root();
    let mut paths = Vec::new();
    for dir in crate_dirs(&root)? {
        rust_files(&dir.join("src"), &mut paths)?;
    }
    ensure!(paths.len() > 100, "found only {} source files", paths.len());
    let files = paths
        .iter()
        .map(|p| {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?;
            let rel = p.strip_prefix(&root).unwrap_or(p).display().to_string();
            Ok((rel, text))
        })
        .collect::<Result<Vec<_>>>()?;
    let cycles = imports::import_cycles(&files)?;
    ensure!(
        cycles.is_empty(),
        "files that import each other (move what an edge names so the edges go one way):\n{}",
        cycles.iter().map(ToString::to_string).collect::<String>()
    );
    Ok(())
}

fn planted(files: &[(&str, &str)]) -> Vec<(String, String)> {
    files
        .iter()
        .map(|(p, t)| ((*p).to_string(), (*t).to_string()))
        .collect()
}

#[test]
fn the_cycle_finder_reports_planted_cycles_and_passes_acyclic_files() -> Result<()> {
    // a.rs names `crate::Thing`, which lib.rs re-exports from b.rs, and b.rs imports a.rs's
    // Helper; in `up`, the parent names its child's item and the child names the parent's.
    let cyclic = planted(&[
        (
            "fake/src/lib.rs",
            "mod a;\nmod b;\nmod up;\npub use b::Thing;\n",
        ),
        (
            "fake/src/a.rs",
            "pub struct Helper;\npub fn make() -> crate::Thing {\n    crate::Thing(Helper)\n}\n",
        ),
        (
            "fake/src/b.rs",
            "use crate::a::Helper;\npub struct Thing(pub Helper);\n",
        ),
        (
            "fake/src/up/mod.rs",
            "mod child;\npub struct Shared;\npub fn run() { child::go(); }\n",
        ),
        (
            "fake/src/up/child.rs",
            "pub fn go() { let _ = super::Shared; }\n",
        ),
    ]);
    let cycles = imports::import_cycles(&cyclic)?;
    let shown: String = cycles.iter().map(ToString::to_string).collect();
    ensure!(cycles.len() == 2, "want 2 cycles, found:\n{shown}");
    ensure!(
        cycles[0].files == ["fake/src/a.rs", "fake/src/b.rs"],
        "first cycle: {shown}"
    );
    ensure!(
        cycles[1].files == ["fake/src/up/child.rs", "fake/src/up/mod.rs"],
        "second cycle: {shown}"
    );
    for named in [
        "fake/src/a.rs -> fake/src/b.rs: fake/src/a.rs:2 crate::Thing",
        "fake/src/b.rs -> fake/src/a.rs: fake/src/b.rs:1 crate::a::Helper",
        "fake/src/up/child.rs -> fake/src/up/mod.rs: fake/src/up/child.rs:1 super::Shared",
        "fake/src/up/mod.rs -> fake/src/up/child.rs: fake/src/up/mod.rs:3 child::go",
    ] {
        ensure!(shown.contains(named), "no {named:?} in:\n{shown}");
    }

    // The same crate with the edges going one way: b.rs keeps its own Helper; the names in a
    // comment, a string, a test module and a pure re-export are not edges; the child names
    // only a sibling.
    let acyclic = planted(&[
        (
            "fake/src/lib.rs",
            "mod a;\nmod b;\nmod up;\npub use b::Thing;\n",
        ),
        (
            "fake/src/a.rs",
            "pub fn make() -> crate::Thing {\n    crate::Thing(crate::b::Helper)\n}\n",
        ),
        (
            "fake/src/b.rs",
            "// crate::a::make\npub struct Helper;\npub struct Thing(pub Helper);\n\
             const S: &str = \"crate::a::make\";\n\
             #[cfg(test)]\nmod tests {\n    use crate::a::make;\n}\n",
        ),
        (
            "fake/src/up/mod.rs",
            "mod child;\nmod shared;\npub use child::go;\npub fn run() { go(); }\n",
        ),
        ("fake/src/up/shared.rs", "pub struct Shared;\n"),
        (
            "fake/src/up/child.rs",
            "pub fn go() { let _ = super::shared::Shared; }\n",
        ),
    ]);
    let cycles = imports::import_cycles(&acyclic)?;
    ensure!(
        cycles.is_empty(),
        "acyclic files reported:\n{}",
        cycles.iter().map(ToString::to_string).collect::<String>()
    );
    Ok(())
}
