//! The import graph between the files of each crate, and its cycles, for
//! `house.rs::no_import_cycles_between_files` (on the checkout) and its tests (on planted
//! files). It takes `(path, text)` pairs and reads each file with a small tokenizer: comments,
//! strings and `#[cfg(test)]` items are dropped. The module tree is walked from `src/lib.rs`
//! and `src/main.rs` (each its own crate) through `mod x;` declarations, inline `mod x { }`
//! staying in their file. A file depends on the file that defines what it names: in `use`
//! trees and in qualified paths in code (`crate::a::B`, `super::f(`, `child::C`), through
//! re-exports (`pub use`) and imports of the modules in between. A `pub use` the file does not
//! use itself is a facade, not an edge; declaring a child (`mod x;`) is not an edge either.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;

use anyhow::{bail, Result};

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
}

#[derive(Debug)]
struct Token {
    tok: Tok,
    line: usize,
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Identifiers, `::` and punctuation, without comments, strings, chars, lifetimes, numbers.
fn tokenize(text: &str) -> Vec<Token> {
    let c: Vec<char> = text.chars().collect();
    let at = |j: usize| c.get(j).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < c.len() {
        let start = i;
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if let Some(end) = literal_end(&c, i) {
            i = end;
        } else if ch == '\'' {
            // A lifetime or a label: skip it.
            i += 1;
            while i < c.len() && is_ident_char(c[i]) {
                i += 1;
            }
        } else if ch == 'r' && at(i + 1) == '#' && is_ident_start(at(i + 2)) {
            i += 2;
            let from = i;
            while i < c.len() && is_ident_char(c[i]) {
                i += 1;
            }
            let tok = Tok::Ident(c[from..i].iter().collect());
            out.push(Token { tok, line });
        } else if is_ident_start(ch) {
            while i < c.len() && is_ident_char(c[i]) {
                i += 1;
            }
            let tok = Tok::Ident(c[start..i].iter().collect());
            out.push(Token { tok, line });
        } else if ch.is_ascii_digit() {
            while i < c.len() && is_ident_char(c[i]) {
                i += 1;
            }
        } else if ch == ':' && at(i + 1) == ':' {
            out.push(Token {
                tok: Tok::Sep,
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                tok: Tok::Punct(ch),
                line,
            });
            i += 1;
        }
        line += c[start..i].iter().filter(|&&x| x == '\n').count();
    }
    out
}

/// Where a string or char literal starting at `i` ends (`"…"`, `r#"…"#`, `b"…"`, `'x'`).
fn literal_end(c: &[char], i: usize) -> Option<usize> {
    let at = |j: usize| c.get(j).copied().unwrap_or('\0');
    if i > 0 && is_ident_char(c[i - 1]) {
        return None;
    }
    let mut j = i;
    if at(j) == 'b' || at(j) == 'c' {
        j += 1;
    }
    if at(j) == 'r' && (at(j + 1) == '"' || at(j + 1) == '#') {
        j += 1;
        let mut hashes = 0;
        while at(j) == '#' {
            hashes += 1;
            j += 1;
        }
        if at(j) != '"' {
            return None;
        }
        j += 1;
        while j < c.len() {
            if c[j] == '"' && (1..=hashes).all(|k| at(j + k) == '#') {
                return Some(j + 1 + hashes);
            }
            j += 1;
        }
        return Some(c.len());
    }
    match at(j) {
        '"' => {
            j += 1;
            while j < c.len() {
                match c[j] {
                    '\\' => j += 2,
                    '"' => return Some(j + 1),
                    _ => j += 1,
                }
            }
            Some(c.len())
        }
        '\'' if at(j + 1) == '\\' => {
            j += 2;
            while j < c.len() && c[j] != '\'' {
                j += 1;
            }
            Some(j + 1)
        }
        '\'' if at(j + 2) == '\'' => Some(j + 3),
        _ => None,
    }
}

/// One name a `use` tree brings in (`binding`), or a glob.
#[derive(Debug, Clone)]
struct UseLeaf {
    path: Vec<String>,
    binding: Option<String>,
    glob: bool,
    public: bool,
}

/// A module's body inside one file: the file's own module, or an inline `mod x { }`.
#[derive(Debug, Default)]
struct Scope {
    name: String,
    parent: Option<usize>,
    /// `mod x;`: children in files of their own.
    decls: Vec<String>,
    /// Items defined at the module's level.
    defs: BTreeSet<String>,
    /// `use` items at the module's level (what other modules can name through it).
    uses: Vec<UseLeaf>,
    /// `use` items in blocks (what only this file's code names).
    block_uses: Vec<UseLeaf>,
}

#[derive(Debug)]
enum RefKind {
    Use(UseLeaf),
    Code,
}

/// A path a file names: in a `use` tree or in its code.
#[derive(Debug)]
struct Ref {
    scope: usize,
    path: Vec<String>,
    line: usize,
    kind: RefKind,
}

#[derive(Debug, Default)]
struct Parsed {
    scopes: Vec<Scope>,
    refs: Vec<Ref>,
    /// Every identifier outside `use` items: what the file's own code mentions.
    code_idents: BTreeSet<String>,
}

const DEF_KEYWORDS: [&str; 8] = [
    "fn", "struct", "enum", "trait", "type", "const", "static", "union",
];

fn ident(tokens: &[Token], j: usize) -> Option<&str> {
    match tokens.get(j).map(|t| &t.tok) {
        Some(Tok::Ident(s)) => Some(s),
        _ => None,
    }
}

fn is(tokens: &[Token], j: usize, tok: &Tok) -> bool {
    tokens.get(j).is_some_and(|t| &t.tok == tok)
}

/// The index of the bracket closing the one at `open`.
fn matching(tokens: &[Token], open: usize) -> usize {
    let mut depth = 0usize;
    for (j, t) in tokens.iter().enumerate().skip(open) {
        match t.tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return j;
                }
            }
            _ => {}
        }
    }
    tokens.len()
}

/// Past the item starting at `i` (after a `#[cfg(test)]`): to its `;` or its closing `}`.
fn skip_item(tokens: &[Token], mut i: usize) -> usize {
    while is(tokens, i, &Tok::Punct('#')) {
        let open = if is(tokens, i + 1, &Tok::Punct('!')) {
            i + 2
        } else {
            i + 1
        };
        i = matching(tokens, open) + 1;
    }
    let mut nested = 0usize;
    while let Some(t) = tokens.get(i) {
        match t.tok {
            Tok::Punct('(' | '[') => nested += 1,
            Tok::Punct(')' | ']' | '}') if nested == 0 => return i,
            Tok::Punct(')' | ']') => nested -= 1,
            Tok::Punct('{') if nested == 0 => return matching(tokens, i) + 1,
            Tok::Punct(';') if nested == 0 => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

/// Whether the `use` at `i` is `pub` or `pub(…)`.
fn is_public(tokens: &[Token], i: usize) -> bool {
    if i == 0 {
        return false;
    }
    if ident(tokens, i - 1) == Some("pub") {
        return true;
    }
    if is(tokens, i - 1, &Tok::Punct(')')) {
        let mut j = i - 1;
        while j > 0 && !is(tokens, j, &Tok::Punct('(')) {
            j -= 1;
        }
        return j > 0 && ident(tokens, j - 1) == Some("pub");
    }
    false
}

/// One `use` tree from `j`, under `prefix`; returns where it ends.
fn use_tree(tokens: &[Token], mut j: usize, prefix: &[String], out: &mut Vec<UseLeaf>) -> usize {
    let mut path = prefix.to_vec();
    if path.is_empty() && is(tokens, j, &Tok::Sep) {
        path.push(String::new());
        j += 1;
    }
    let leaf = |path: Vec<String>, binding, glob| UseLeaf {
        path,
        binding,
        glob,
        public: false,
    };
    loop {
        match tokens.get(j).map(|t| &t.tok) {
            Some(Tok::Ident(name)) => {
                path.push(name.clone());
                j += 1;
                if is(tokens, j, &Tok::Sep) {
                    j += 1;
                    continue;
                }
                if name == "self" {
                    path.pop();
                }
                let mut binding = path.last().cloned();
                if ident(tokens, j) == Some("as") {
                    binding = ident(tokens, j + 1)
                        .filter(|b| *b != "_")
                        .map(str::to_string);
                    j += 2;
                }
                out.push(leaf(path, binding, false));
                return j;
            }
            Some(Tok::Punct('*')) => {
                out.push(leaf(path, None, true));
                return j + 1;
            }
            Some(Tok::Punct('{')) => {
                j += 1;
                loop {
                    if is(tokens, j, &Tok::Punct('}')) || j >= tokens.len() {
                        return j + 1;
                    }
                    let next = use_tree(tokens, j, &path, out);
                    j = if next == j { j + 1 } else { next };
                    if is(tokens, j, &Tok::Punct(',')) {
                        j += 1;
                    }
                }
            }
            _ => return j,
        }
    }
}

fn parse(text: &str) -> Parsed {
    let tokens = tokenize(text);
    let mut p = Parsed {
        scopes: vec![Scope::default()],
        ..Parsed::default()
    };
    // (scope, brace depth of its body)
    let mut stack: Vec<(usize, usize)> = vec![(0, 0)];
    let mut depth = 0usize;
    let mut i = 0;
    while let Some(t) = tokens.get(i) {
        let (scope, body) = stack.last().copied().unwrap_or((0, 0));
        let module_level = depth == body;
        match &t.tok {
            Tok::Punct('#') => {
                let open = if is(&tokens, i + 1, &Tok::Punct('!')) {
                    i + 2
                } else {
                    i + 1
                };
                if !is(&tokens, open, &Tok::Punct('[')) {
                    i += 1;
                    continue;
                }
                let end = matching(&tokens, open);
                let attr: Vec<&Tok> = tokens[open + 1..end.min(tokens.len())]
                    .iter()
                    .map(|t| &t.tok)
                    .collect();
                let cfg_test = attr.len() == 4
                    && *attr[0] == Tok::Ident("cfg".into())
                    && *attr[2] == Tok::Ident("test".into());
                i = end + 1;
                if cfg_test {
                    i = skip_item(&tokens, i);
                }
            }
            Tok::Punct('$') => i += 2,
            Tok::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                if stack.len() > 1 && depth < body {
                    stack.pop();
                }
                i += 1;
            }
            Tok::Ident(kw) if kw == "mod" && module_level => {
                let Some(name) = ident(&tokens, i + 1).map(str::to_string) else {
                    i += 1;
                    continue;
                };
                if is(&tokens, i + 2, &Tok::Punct('{')) {
                    p.scopes.push(Scope {
                        name: name.clone(),
                        parent: Some(scope),
                        ..Scope::default()
                    });
                    stack.push((p.scopes.len() - 1, depth + 1));
                    depth += 1;
                } else {
                    p.scopes[scope].decls.push(name.clone());
                }
                p.scopes[scope].defs.insert(name);
                i += 3;
            }
            Tok::Ident(kw) if kw == "use" => {
                let mut leaves = Vec::new();
                let end = use_tree(&tokens, i + 1, &[], &mut leaves);
                let public = is_public(&tokens, i);
                for mut leaf in leaves {
                    leaf.public = public;
                    let s = &mut p.scopes[scope];
                    if module_level {
                        s.uses.push(leaf.clone());
                    } else {
                        s.block_uses.push(leaf.clone());
                    }
                    p.refs.push(Ref {
                        scope,
                        path: leaf.path.clone(),
                        line: t.line,
                        kind: RefKind::Use(leaf),
                    });
                }
                i = end.max(i + 1);
            }
            Tok::Ident(name) => {
                p.code_idents.insert(name.clone());
                if module_level && DEF_KEYWORDS.contains(&name.as_str()) {
                    let mut j = i + 1;
                    if ident(&tokens, j) == Some("mut") {
                        j += 1;
                    }
                    if let Some(def) = ident(&tokens, j).filter(|d| *d != "fn") {
                        p.scopes[scope].defs.insert(def.to_string());
                    }
                }
                if name == "macro_rules" && is(&tokens, i + 1, &Tok::Punct('!')) {
                    if let Some(def) = ident(&tokens, i + 2) {
                        p.scopes[scope].defs.insert(def.to_string());
                    }
                }
                let starts_path =
                    is(&tokens, i + 1, &Tok::Sep) && (i == 0 || !is(&tokens, i - 1, &Tok::Sep));
                if !starts_path {
                    i += 1;
                    continue;
                }
                let mut path = vec![name.clone()];
                let mut j = i + 1;
                while is(&tokens, j, &Tok::Sep) {
                    let Some(seg) = ident(&tokens, j + 1) else {
                        break;
                    };
                    path.push(seg.to_string());
                    p.code_idents.insert(seg.to_string());
                    j += 2;
                }
                p.refs.push(Ref {
                    scope,
                    path,
                    line: t.line,
                    kind: RefKind::Code,
                });
                i = j;
            }
            _ => i += 1,
        }
    }
    p
}

struct File {
    path: String,
    parsed: Parsed,
    /// The module of each scope.
    modules: Vec<usize>,
}

struct Module {
    file: usize,
    scope: usize,
    parent: Option<usize>,
    root: usize,
    children: BTreeMap<String, usize>,
}

#[derive(Debug, Clone, PartialEq)]
enum Target {
    Module(usize),
    /// The file defining an item.
    Item(usize),
    External,
}

const MAX_HOPS: usize = 24;

struct Crates<'a> {
    texts: HashMap<&'a str, &'a str>,
    files: Vec<File>,
    modules: Vec<Module>,
}

impl Crates<'_> {
    /// Adds a file as module `name` of `parent`, and the files it declares, recursively.
    fn add_file(&mut self, path: &str, parent: Option<usize>, name: &str, dir: &str) -> Result<()> {
        let Some(text) = self.texts.get(path) else {
            bail!("no file {path}");
        };
        let parsed = parse(text);
        let file = self.files.len();
        let mut modules = Vec::new();
        let mut dirs = Vec::new();
        for (k, scope) in parsed.scopes.iter().enumerate() {
            let (parent, name, dir) = match scope.parent {
                None => (parent, name.to_string(), dir.to_string()),
                Some(p) => (
                    Some(modules[p]),
                    scope.name.clone(),
                    format!("{}/{}", dirs[p], scope.name),
                ),
            };
            let id = self.modules.len();
            let root = parent.map_or(id, |p| self.modules[p].root);
            self.modules.push(Module {
                file,
                scope: k,
                parent,
                root,
                children: BTreeMap::new(),
            });
            if let Some(p) = parent {
                self.modules[p].children.insert(name, id);
            }
            modules.push(id);
            dirs.push(dir);
        }
        let decls: Vec<(usize, String, String)> = parsed
            .scopes
            .iter()
            .enumerate()
            .flat_map(|(k, s)| s.decls.iter().map(move |d| (k, d.clone())))
            .map(|(k, d)| (modules[k], d, dirs[k].clone()))
            .collect();
        self.files.push(File {
            path: path.to_string(),
            parsed,
            modules,
        });
        for (module, child, dir) in decls {
            let candidates = [format!("{dir}/{child}.rs"), format!("{dir}/{child}/mod.rs")];
            let Some(found) = candidates
                .iter()
                .find(|c| self.texts.contains_key(c.as_str()))
            else {
                bail!("{path}: `mod {child};` has no file ({dir}/{child}.rs or …/mod.rs)");
            };
            self.add_file(found, Some(module), &child, &format!("{dir}/{child}"))?;
        }
        Ok(())
    }

    fn scope(&self, m: usize) -> &Scope {
        let md = &self.modules[m];
        &self.files[md.file].parsed.scopes[md.scope]
    }

    /// What `name` denotes in module `m`, if the crate's files say.
    fn lookup(&self, m: usize, name: &str, local: bool, hops: usize) -> Option<Target> {
        if hops > MAX_HOPS {
            return Some(Target::External);
        }
        if let Some(&c) = self.modules[m].children.get(name) {
            return Some(Target::Module(c));
        }
        let scope = self.scope(m);
        let block = if local { &scope.block_uses[..] } else { &[] };
        let bound = scope.uses.iter().chain(block);
        if let Some(u) = bound
            .filter(|u| u.binding.as_deref() == Some(name))
            .find(|u| u.path.len() > 1 || u.path.first().is_some_and(|s| s != name))
        {
            return Some(self.resolve(m, &u.path, false, hops + 1));
        }
        if scope.defs.contains(name) {
            return Some(Target::Item(self.modules[m].file));
        }
        for u in scope.uses.iter().filter(|u| u.glob) {
            if let Target::Module(g) = self.resolve(m, &u.path, false, hops + 1) {
                if let Some(t) = self.lookup(g, name, false, hops + 1) {
                    return Some(t);
                }
            }
        }
        None
    }

    /// What a path written in module `m` denotes (`local`: from `m`'s own file).
    fn resolve(&self, m: usize, path: &[String], local: bool, hops: usize) -> Target {
        let Some(first) = path.first() else {
            return Target::Module(m);
        };
        let mut cur = m;
        let mut rest = 1;
        match first.as_str() {
            "crate" => cur = self.modules[m].root,
            "self" => {}
            "super" => {
                rest = 0;
                while path.get(rest).is_some_and(|s| s == "super") {
                    let Some(p) = self.modules[cur].parent else {
                        return Target::External;
                    };
                    cur = p;
                    rest += 1;
                }
            }
            _ => match self.lookup(m, first, local, hops) {
                Some(Target::Module(c)) => cur = c,
                Some(t) => return t,
                None => return Target::External,
            },
        }
        for seg in &path[rest..] {
            match self.lookup(cur, seg, false, hops + 1) {
                Some(Target::Module(c)) => cur = c,
                Some(t) => return t,
                // Not found (generated, say): take it for the module's own file.
                None => return Target::Item(self.modules[cur].file),
            }
        }
        Target::Module(cur)
    }

    /// Each file's edges to the files it depends on, with what it names there.
    fn edges(&self) -> BTreeMap<(usize, usize), Vec<String>> {
        let mut edges: BTreeMap<(usize, usize), Vec<String>> = BTreeMap::new();
        for (f, file) in self.files.iter().enumerate() {
            let code = &file.parsed.code_idents;
            for r in &file.parsed.refs {
                let m = file.modules[r.scope];
                let label = format!("{}:{} {}", file.path, r.line, r.path.join("::"));
                let mut targets = Vec::new();
                match &r.kind {
                    RefKind::Use(u) if u.glob => {
                        if u.public {
                            continue;
                        }
                        match self.resolve(m, &u.path, true, 0) {
                            Target::Module(g) => {
                                for name in code {
                                    if let Some(Target::Item(t)) = self.lookup(g, name, false, 0) {
                                        targets.push((t, format!("{label}::* ({name})")));
                                    }
                                }
                            }
                            Target::Item(t) => targets.push((t, format!("{label}::*"))),
                            Target::External => {}
                        }
                    }
                    RefKind::Use(u) => {
                        // A re-export the file does not use itself is a facade.
                        let used = u.binding.as_ref().is_some_and(|b| code.contains(b));
                        if u.public && !used {
                            continue;
                        }
                        if let Target::Item(t) = self.resolve(m, &u.path, true, 0) {
                            targets.push((t, label));
                        }
                    }
                    RefKind::Code => {
                        // `Name::x` where a `use` brought `Name` in: that `use` is the edge.
                        let first = r.path.first().map_or("", String::as_str);
                        let imported = !matches!(first, "crate" | "self" | "super")
                            && matches!(self.lookup(m, first, true, 0), Some(Target::Item(_)));
                        if imported {
                            continue;
                        }
                        if let Target::Item(t) = self.resolve(m, &r.path, true, 0) {
                            targets.push((t, label));
                        }
                    }
                }
                for (t, label) in targets.into_iter().filter(|(t, _)| *t != f) {
                    let labels = edges.entry((f, t)).or_default();
                    if !labels.contains(&label) {
                        labels.push(label);
                    }
                }
            }
        }
        edges
    }
}

/// Files that import each other, and one chain of edges around them.
#[derive(Debug)]
pub struct Cycle {
    pub files: Vec<String>,
    /// `(from, to, what from names in to)`, from the first file back to it.
    pub chain: Vec<(String, String, Vec<String>)>,
}

impl fmt::Display for Cycle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "cycle of {} files: {}",
            self.files.len(),
            self.files.join(", ")
        )?;
        for (from, to, labels) in &self.chain {
            let shown: Vec<&str> = labels.iter().take(3).map(String::as_str).collect();
            let more = labels.len().saturating_sub(3);
            let more = if more > 0 {
                format!(" (+{more} more)")
            } else {
                String::new()
            };
            writeln!(f, "  {from} -> {to}: {}{more}", shown.join("; "))?;
        }
        Ok(())
    }
}

/// Strongly connected components of more than one node (Tarjan).
fn components(n: usize, adj: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        adj: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State<'_>, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in &s.adj[v] {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        adj,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The import cycles between the files of each crate among `files` (`(path, text)`, paths
/// like `shared/src/api.rs`; every `…/src/lib.rs` and `…/src/main.rs` is a crate root).
pub fn import_cycles(files: &[(String, String)]) -> Result<Vec<Cycle>> {
    let mut crates = Crates {
        texts: files
            .iter()
            .map(|(p, t)| (p.as_str(), t.as_str()))
            .collect(),
        files: Vec::new(),
        modules: Vec::new(),
    };
    let mut roots: Vec<&str> = files
        .iter()
        .map(|(p, _)| p.as_str())
        .filter(|p| p.ends_with("src/lib.rs") || p.ends_with("src/main.rs"))
        .collect();
    roots.sort();
    for root in roots {
        let dir = root.rsplit_once('/').map_or("", |(d, _)| d);
        crates.add_file(root, None, "crate", dir)?;
    }
    let edges = crates.edges();
    let n = crates.files.len();
    let mut adj = vec![Vec::new(); n];
    for &(from, to) in edges.keys() {
        adj[from].push(to);
    }
    let path = |f: usize| crates.files[f].path.clone();
    let mut cycles = Vec::new();
    for comp in components(n, &adj) {
        let mut members: Vec<usize> = comp;
        members.sort_by_key(|&f| path(f));
        let start = members[0];
        // The shortest way from the first file back to it, inside the component.
        let mut came_from: HashMap<usize, usize> = HashMap::new();
        let mut queue = VecDeque::from([start]);
        let mut last = None;
        while let Some(v) = queue.pop_front() {
            for &w in &adj[v] {
                if w == start {
                    last = Some(v);
                    break;
                }
                if members.contains(&w) && !came_from.contains_key(&w) {
                    came_from.insert(w, v);
                    queue.push_back(w);
                }
            }
            if last.is_some() {
                break;
            }
        }
        let mut back = Vec::new();
        let mut v = last.unwrap_or(start);
        while v != start {
            back.push(v);
            v = came_from.get(&v).copied().unwrap_or(start);
        }
        back.reverse();
        let nodes: Vec<usize> = std::iter::once(start)
            .chain(back)
            .chain(std::iter::once(start))
            .collect();
        let chain = nodes
            .windows(2)
            .map(|w| {
                let labels = edges.get(&(w[0], w[1])).cloned().unwrap_or_default();
                (path(w[0]), path(w[1]), labels)
            })
            .collect();
        cycles.push(Cycle {
            files: members.into_iter().map(path).collect(),
            chain,
        });
    }
    cycles.sort_by(|a, b| a.files.cmp(&b.files));
    Ok(cycles)
}
