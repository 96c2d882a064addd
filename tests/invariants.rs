//! The invariants of ARCHITECTURE.md that a reading of the source tree can decide, checked on
//! every `cargo test`:
//! - only `core::db` and the built-in kinds' tables (`agentq-kinds`' `tables`) contain SQL
//!   ([`only_core_db_contains_sql`]), and the benchmarks' fixtures (`bench/src/fixtures.rs`);
//! - only `core::broker` imports `lapin` ([`only_core_broker_imports_lapin`]);
//! - no engine crate depends on the `agentq` crate, the command line over a registry
//!   ([`no_engine_crate_depends_on_the_entry_point`]): only deployments (`examples/`) do;
//! - the modules of each library crate import each other without a cycle
//!   ([`library_modules_import_each_other_without_a_cycle`]);
//! - the SDK a kind is written with (`sdk/rust`) names no database or broker client and
//!   depends on none ([`the_sdk_names_no_database_or_broker`]).
//!
//! Plain Rust over the files, no dependency: a small lexer that knows comments, strings, raw
//! strings and char literals, so a word in a comment or a log filter (`"lapin=warn"`) is not
//! taken for code, and an SQL keyword is looked for only at the start of a string literal.
//! Exceptions are listed with their reason; one that no longer matches anything fails too, so
//! the lists only shrink.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Component, Path, PathBuf};

/// The workspace root (the binary's package is the root package).
fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The product code: every library crate and the binary. `tests/` (the e2e and chaos suites,
/// which set up and inspect databases and brokers themselves) is not product code.
const PRODUCT_DIRS: &[&str] = &[
    "core",
    "sdk/rust",
    "producer",
    "worker",
    "kinds",
    "scheduler",
    "app",
    "http",
    "src",
    "bench",
];

/// The library crates whose top-level modules must not import each other in a cycle.
const LIBRARY_CRATES: &[&str] = &[
    "core",
    "sdk/rust",
    "producer",
    "worker",
    "kinds",
    "scheduler",
    "app",
    "http",
];

/// Names that only SQL-running code uses: sqlx's query functions and macros (`sqlx::query`
/// itself is matched as a path, as `query` alone is a common word), its raw SQL entry points
/// and its builder of dynamic SQL.
const SQL_IDENTS: &[&str] = &[
    "query_as",
    "query_as_with",
    "query_as_unchecked",
    "query_scalar",
    "query_scalar_with",
    "query_scalar_unchecked",
    "query_with",
    "query_unchecked",
    "query_file",
    "query_file_as",
    "query_file_scalar",
    "raw_sql",
    "AssertSqlSafe",
    "QueryBuilder",
];

/// A string literal starting with one of these words and a space (or a line break) is SQL.
const SQL_KEYWORDS: &[&str] = &["SELECT", "INSERT", "UPDATE", "DELETE", "CREATE", "ALTER"];

/// A finding that is known and tolerated: the file, exactly what was found there, and why.
struct Allowed {
    file: &'static str,
    found: &'static str,
    why: &'static str,
}

/// The directories (and files) whose files may contain SQL: the engine's database layer, the
/// built-in kinds' own tables (`agent_kv`, `ledger_effects`, `doc_migration`'s source and
/// target tables), and the benchmarks' bulk fixtures and reads.
const SQL_DIRS: &[&str] = &["core/src/db/", "kinds/src/tables/", "bench/src/fixtures.rs"];

/// SQL outside [`SQL_DIRS`] that the check tolerates.
const SQL_ALLOWED: &[Allowed] = &[
    Allowed {
        file: "core/src/state.rs",
        found: "\"CREATE TABLE operation_steps\"",
        why: "a unit test looks this text up in a migration file; no statement is run",
    },
    Allowed {
        file: "core/src/state.rs",
        found: "\"CREATE TABLE dead_letters\"",
        why: "a unit test looks this text up in a migration file; no statement is run",
    },
    Allowed {
        file: "core/src/state/transition/tests.rs",
        found: "\"UPDATE operations\"",
        why: "the status-writer test looks this text up in core/src/db and the migrations; no statement is run",
    },
    Allowed {
        file: "core/src/state/transition/tests.rs",
        found: "\"CREATE FUNCTION f() RETURNS trigger AS $$ BEGIN UPDATE operations SET status = 'dead' WHERE id = 1; END $$\"",
        why: "the status-writer test's own check: a broken trigger it must flag; no statement is run",
    },
    Allowed {
        file: "core/src/state/transition/batch.rs",
        found: "\"UPDATE batches\"",
        why: "the batch status-writer test looks this text up in core/src/db; no statement is run",
    },
];

/// `lapin` outside `core/src/broker/` that the check tolerates: none.
const LAPIN_ALLOWED: &[Allowed] = &[];

/// Imports between top-level modules that close a cycle and are tolerated, as
/// `(crate, from, to, why)`; the check drops them from the graph before looking for cycles.
/// None.
const CYCLE_ALLOWED: &[(&str, &str, &str, &str)] = &[];

// ---------------------------------------------------------------------------------------------
// The checks.

#[test]
fn only_core_db_contains_sql() {
    let mut findings = Vec::new();
    for file in rust_files(PRODUCT_DIRS) {
        if SQL_DIRS.iter().any(|dir| file.starts_with(dir)) {
            continue;
        }
        let tokens = lex(&read(&file));
        for (i, t) in tokens.iter().enumerate() {
            match &t.tok {
                Tok::Ident(name) => {
                    let sqlx_query =
                        name.starts_with("query") && path_before(&tokens, i) == ["sqlx"];
                    if sqlx_query {
                        findings.push(Finding::new(&file, t.line, &format!("sqlx::{name}")));
                    } else if SQL_IDENTS.contains(&name.as_str()) {
                        findings.push(Finding::new(&file, t.line, name));
                    }
                }
                Tok::Str(text) => {
                    if starts_with_sql(text) {
                        let first_line = text.trim_start().lines().next().unwrap_or_default();
                        findings.push(Finding::new(&file, t.line, &format!("\"{first_line}\"")));
                    }
                }
                Tok::Punct(_) => {}
            }
        }
        // `use sqlx::{query, …}` brings `sqlx::query` in without writing the path.
        for (at, path) in use_paths(&tokens) {
            if path.len() >= 2 && path[0] == "sqlx" && path[1] == "query" {
                findings.push(Finding::new(&file, tokens[at].line, "sqlx::query"));
            }
        }
    }
    assert_allowed(
        "SQL outside core/src/db/, kinds/src/tables/ and bench/src/fixtures.rs",
        findings,
        SQL_ALLOWED,
    );
}

#[test]
fn only_core_broker_imports_lapin() {
    let mut findings = Vec::new();
    for file in rust_files(PRODUCT_DIRS) {
        if file.starts_with("core/src/broker/") {
            continue;
        }
        for t in lex(&read(&file)) {
            if t.tok == Tok::Ident("lapin".into()) {
                findings.push(Finding::new(&file, t.line, "lapin"));
            }
        }
    }
    assert_allowed("lapin outside core/src/broker/", findings, LAPIN_ALLOWED);
}

#[test]
fn no_engine_crate_depends_on_the_entry_point() {
    let mut findings = Vec::new();
    // No manifest but a deployment's names the root package (by name, `package =` or a path
    // to it) among its dependencies, nor does the workspace offer it to members
    // (`agentq.workspace = true`).
    let mut manifests: Vec<String> = member_manifests()
        .into_iter()
        .filter(|m| !m.starts_with("examples/"))
        .collect();
    manifests.push("Cargo.toml".into());
    for manifest in manifests {
        let dir = Path::new(&manifest).parent().unwrap();
        for (line, dep) in dependencies(&read(&manifest)) {
            let to_root = dep
                .path
                .as_deref()
                .is_some_and(|p| normalize(&dir.join(p)) == Path::new(""));
            if dep.name == "agentq" || dep.package.as_deref() == Some("agentq") || to_root {
                findings.push(Finding::new(&manifest, line, &dep.name));
            }
        }
    }
    // No library crate names the entry point's paths (`agentq::…`; its own are `crate::…`), and
    // no file outside `src/` compiles one of its files in (`#[path]`, `include!`).
    for file in rust_files(LIBRARY_CRATES) {
        for t in lex(&read(&file)) {
            if t.tok == Tok::Ident("agentq".into()) {
                findings.push(Finding::new(&file, t.line, "agentq"));
            }
        }
    }
    let outside_src: Vec<&str> = LIBRARY_CRATES.iter().copied().chain(["tests"]).collect();
    for file in rust_files(&outside_src) {
        let tokens = lex(&read(&file));
        for (line, target) in included_files(&tokens) {
            let resolved = normalize(&Path::new(&file).parent().unwrap().join(&target));
            if resolved.starts_with("src") {
                findings.push(Finding::new(&file, line, &target));
            }
        }
    }
    assert_allowed("a dependency on the entry point crate", findings, &[]);
}

#[test]
fn library_modules_import_each_other_without_a_cycle() {
    let mut failures = Vec::new();
    // The library crates, and the binary (`.`) too.
    for krate in LIBRARY_CRATES.iter().chain(&["."]) {
        let mut graph = module_graph(krate);
        for (_, from, to, why) in CYCLE_ALLOWED.iter().filter(|(k, ..)| k == krate) {
            let edges = graph.get_mut(*from);
            if edges.and_then(|e| e.remove(*to)).is_none() {
                failures.push(format!(
                    "{krate}: {from} → {to} is allowed but no longer imported (remove it): {why}"
                ));
            }
        }
        for cycle in cycles(&graph) {
            let mut text = format!("{krate}: {}", cycle.join(" → "));
            for (from, to) in cycle.iter().zip(cycle.iter().skip(1)) {
                let (file, line) = &graph[from][to];
                text.push_str(&format!("\n    {from} → {to} at {file}:{line}"));
            }
            failures.push(text);
        }
    }
    assert!(
        failures.is_empty(),
        "module cycles (each edge shown at one place it is used):\n{}",
        failures.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// Findings and their exceptions.

#[derive(Debug)]
struct Finding {
    file: String,
    line: usize,
    found: String,
}

impl Finding {
    fn new(file: &str, line: usize, found: &str) -> Self {
        Self {
            file: file.to_string(),
            line,
            found: found.to_string(),
        }
    }

    fn is(&self, allowed: &Allowed) -> bool {
        self.file == allowed.file && self.found == allowed.found
    }
}

/// Fails listing every finding no exception covers, and every exception nothing matches.
fn assert_allowed(what: &str, mut findings: Vec<Finding>, allowed: &[Allowed]) {
    findings.sort_by(|a, b| (&a.file, a.line, &a.found).cmp(&(&b.file, b.line, &b.found)));
    findings.dedup_by(|a, b| (&a.file, a.line, &a.found) == (&b.file, b.line, &b.found));
    let mut report = String::new();
    for f in findings.iter().filter(|f| !allowed.iter().any(|a| f.is(a))) {
        report.push_str(&format!("\n  {}:{}: {}", f.file, f.line, f.found));
    }
    let stale: Vec<&Allowed> = allowed
        .iter()
        .filter(|a| !findings.iter().any(|f| f.is(a)))
        .collect();
    if !stale.is_empty() {
        report.push_str("\nexceptions that match nothing any more (remove them):");
        for a in stale {
            report.push_str(&format!("\n  {}: {} ({})", a.file, a.found, a.why));
        }
    }
    assert!(report.is_empty(), "{what}:{report}");
}

fn starts_with_sql(literal: &str) -> bool {
    // Leading whitespace, escaped line breaks and `\` line continuations are skipped.
    let mut text = literal;
    loop {
        let trimmed = text.trim_start();
        let next = ["\\n", "\\r", "\\t", "\\"]
            .iter()
            .find_map(|e| trimmed.strip_prefix(e));
        match next {
            Some(rest) => text = rest,
            None => {
                text = trimmed;
                break;
            }
        }
    }
    SQL_KEYWORDS.iter().any(|k| {
        text.strip_prefix(k)
            .is_some_and(|rest| rest.starts_with(char::is_whitespace) || rest.starts_with("\\n"))
    })
}

// ---------------------------------------------------------------------------------------------
// Files and manifests.

/// Every `.rs` file under `dirs`, as paths relative to the root with `/` separators.
fn rust_files(dirs: &[&str]) -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "target") {
                    walk(&path, out);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    for dir in dirs {
        walk(&root().join(dir), &mut out);
    }
    let mut files: Vec<String> = out
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(root()).unwrap();
            let parts: Vec<_> = rel.iter().map(|c| c.to_string_lossy()).collect();
            parts.join("/")
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no Rust files under {dirs:?}");
    files
}

fn read(file: &str) -> String {
    fs::read_to_string(root().join(file)).unwrap_or_else(|e| panic!("reading {file}: {e}"))
}

/// A path made lexically absolute-free: `a/../b/./c` is `b/c`, the root is the empty path.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// The manifests of the workspace's members other than the root package, from `members`.
fn member_manifests() -> Vec<String> {
    let manifest = read("Cargo.toml");
    let at = manifest
        .find("members")
        .expect("the root manifest lists members");
    let list = &manifest[at..];
    let list = &list[list.find('[').unwrap() + 1..list.find(']').unwrap()];
    let members: Vec<String> = list
        .split(',')
        .map(|m| m.trim().trim_matches('"').to_string())
        .filter(|m| !m.is_empty() && m != ".")
        .map(|m| format!("{m}/Cargo.toml"))
        .collect();
    assert!(
        members.len() >= LIBRARY_CRATES.len(),
        "members: {members:?}"
    );
    members
}

/// One dependency as a manifest declares it.
#[derive(Debug, Default)]
struct Dependency {
    name: String,
    package: Option<String>,
    path: Option<String>,
}

/// Every dependency a manifest declares (normal, dev, build, target-specific, and those of
/// `[workspace.dependencies]`), with its line.
fn dependencies(manifest: &str) -> Vec<(usize, Dependency)> {
    let mut out: Vec<(usize, Dependency)> = Vec::new();
    // `Some(None)`: a table of dependencies, one per line; `Some(Some(name))`: the table of
    // one dependency (`[dependencies.name]`); `None`: any other table.
    let mut table: Option<Option<String>> = None;
    for (n, raw) in manifest.lines().enumerate() {
        let line = raw.split('#').next().unwrap().trim();
        if line.starts_with('[') {
            let header = line.trim_matches(['[', ']']).replace([' ', '"', '\''], "");
            let parts: Vec<&str> = header.split('.').collect();
            table = parts
                .iter()
                .position(|p| {
                    ["dependencies", "dev-dependencies", "build-dependencies"].contains(p)
                })
                .map(|k| (k + 1 < parts.len()).then(|| parts[k + 1..].join(".")));
            if let Some(Some(name)) = &table {
                let dep = Dependency {
                    name: name.clone(),
                    ..Default::default()
                };
                out.push((n + 1, dep));
            }
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let key = key.trim().trim_matches('"');
        match &table {
            Some(None) => {
                let dep = Dependency {
                    name: key.split('.').next().unwrap().to_string(),
                    package: field(value, "package"),
                    path: field(value, "path"),
                };
                out.push((n + 1, dep));
            }
            Some(Some(_)) => {
                let dep = &mut out.last_mut().unwrap().1;
                let value = Some(value.trim().trim_matches('"').to_string());
                match key {
                    "package" => dep.package = value,
                    "path" => dep.path = value,
                    _ => {}
                }
            }
            None => {}
        }
    }
    out
}

/// `field = "value"` inside an inline table such as `{ path = "..", package = "agentq" }`.
fn field(inline: &str, name: &str) -> Option<String> {
    inline
        .trim()
        .trim_start_matches('{')
        .trim_end_matches('}')
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| k.trim() == name)
        .map(|(_, v)| v.trim().trim_matches('"').to_string())
}

// ---------------------------------------------------------------------------------------------
// Module graphs.

/// Edges between the top-level modules of a crate: `from → to → (file, line)` of one use.
type Graph = BTreeMap<String, BTreeMap<String, (String, usize)>>;

/// The graph of `krate`'s top-level modules: `a → b` when a file of `a` names a path of `b`
/// (`use crate::b…`, `crate::b::x` in code, `super::b` from `a`'s top file). The crate root is
/// not a node: it declares and re-exports everything.
fn module_graph(krate: &str) -> Graph {
    // `.` is the binary crate at the top of the workspace, its sources in `src/`.
    let (dir, src) = match krate {
        "." => ("src", "src/".to_string()),
        _ => (krate, format!("{krate}/src/")),
    };
    let mut top: BTreeSet<String> = BTreeSet::new();
    let mut uses = Vec::new();
    for file in rust_files(&[dir]) {
        let Some(rel) = file.strip_prefix(&src) else {
            continue;
        };
        let module = file_module(rel);
        let tokens = lex(&read(&file));
        let inline = inline_modules(&tokens);
        match module.first() {
            Some(first) => {
                top.insert(first.clone());
            }
            // The root's inline modules (`mod tests { … }` in lib.rs) are top-level too.
            None => top.extend(inline.iter().map(|(p, _)| p[0].clone())),
        }
        for (at, path) in crate_paths(&tokens) {
            let line = tokens[at].line;
            let mut module = module.clone();
            module.extend(inline_module_at(&inline, at));
            uses.push((file.clone(), line, module, path));
        }
    }
    let mut graph = Graph::new();
    for (file, line, module, path) in uses {
        let Some(target) = resolve(&module, &path) else {
            continue;
        };
        let (Some(from), Some(to)) = (module.first(), target.first()) else {
            continue;
        };
        if from != to && top.contains(to) {
            graph
                .entry(from.clone())
                .or_default()
                .entry(to.clone())
                .or_insert((file.clone(), line));
        }
    }
    graph
}

/// The module path of a file under `src/`: `lib.rs` is the root, `a.rs` and `a/mod.rs` are
/// `a`, `a/b.rs` is `a::b`.
fn file_module(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel.split('/').map(str::to_string).collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if !(parts.is_empty() && (stem == "lib" || stem == "main")) && stem != "mod" {
        parts.push(stem.to_string());
    }
    parts
}

/// The absolute module path a `crate::`, `super::` or `self::` path names, seen from module
/// `at`; `None` for other paths (other crates, or names in scope).
fn resolve(at: &[String], path: &[String]) -> Option<Vec<String>> {
    let first = path.first()?;
    let mut base = at.to_vec();
    let mut rest = path;
    match first.as_str() {
        "crate" => {
            base.clear();
            rest = &path[1..];
        }
        "self" => rest = &path[1..],
        "super" => {
            while rest.first().is_some_and(|s| s == "super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    base.extend(rest.iter().filter(|s| *s != "self" && *s != "*").cloned());
    Some(base)
}

/// Every path starting `crate`, `super` or `self` in a file, in `use` trees and in code,
/// with the index of the token it starts at.
fn crate_paths(tokens: &[Token]) -> Vec<(usize, Vec<String>)> {
    let relative = |p: &str| matches!(p, "crate" | "super" | "self");
    let mut out: Vec<(usize, Vec<String>)> = use_paths(tokens)
        .into_iter()
        .filter(|(_, path)| relative(&path[0]))
        .collect();
    for (i, t) in tokens.iter().enumerate() {
        let Tok::Ident(name) = &t.tok else { continue };
        if !relative(name) || (i > 0 && tokens[i - 1].tok == Tok::Punct("::".into())) {
            continue;
        }
        let mut path = vec![name.clone()];
        let mut j = i + 1;
        while j + 1 < tokens.len() && tokens[j].tok == Tok::Punct("::".into()) {
            let Tok::Ident(seg) = &tokens[j + 1].tok else {
                break;
            };
            path.push(seg.clone());
            j += 2;
        }
        if path.len() > 1 {
            out.push((i, path));
        }
    }
    out
}

/// The inline modules (`mod name { … }`) of a file: each one's path inside the file and the
/// token indices of its braces.
fn inline_modules(tokens: &[Token]) -> Vec<(Vec<String>, (usize, usize))> {
    let mut out = Vec::new();
    // Open braces: for each, whether it opened a module.
    let mut open: Vec<Option<usize>> = Vec::new();
    let mut path: Vec<String> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if t.tok == Tok::Punct("{".into()) {
            let named = i >= 2 && tokens[i - 2].tok == Tok::Ident("mod".into());
            match &tokens[i - 1].tok {
                Tok::Ident(name) if named => {
                    path.push(name.clone());
                    open.push(Some(i));
                }
                _ => open.push(None),
            }
        } else if t.tok == Tok::Punct("}".into())
            && let Some(Some(from)) = open.pop()
        {
            out.push((path.clone(), (from, i)));
            path.pop();
        }
    }
    out
}

/// The innermost inline module around token `at`, as a path inside the file's module.
fn inline_module_at(modules: &[(Vec<String>, (usize, usize))], at: usize) -> Vec<String> {
    modules
        .iter()
        .filter(|(_, (from, to))| *from < at && at < *to)
        .max_by_key(|(path, _)| path.len())
        .map(|(path, _)| path.clone())
        .unwrap_or_default()
}

/// The cycles of a graph: each strongly connected component of more than one module
/// (Tarjan), shown as one cycle through it that starts and ends at the same module.
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct Tarjan<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        components: Vec<Vec<&'g str>>,
    }
    impl<'g> Tarjan<'g> {
        fn visit(&mut self, v: &'g str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            let graph = self.graph;
            for w in graph.get(v).into_iter().flat_map(|e| e.keys()) {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on_stack.remove(w);
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                self.components.push(component);
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.components
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|component| cycle_through(graph, &component))
        .collect()
}

/// A cycle inside a strongly connected component: the shortest way from its first module
/// back to itself (breadth first, staying in the component).
fn cycle_through(graph: &Graph, component: &[&str]) -> Vec<String> {
    let inside: BTreeSet<&str> = component.iter().copied().collect();
    let start = *inside.iter().next().unwrap();
    let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for w in graph.get(v).into_iter().flat_map(|e| e.keys()) {
            let w = w.as_str();
            if !inside.contains(w) || came_from.contains_key(w) {
                continue;
            }
            came_from.insert(w, v);
            if w == start {
                queue.clear();
                break;
            }
            queue.push_back(w);
        }
    }
    let mut path = vec![start.to_string()];
    let mut at = came_from[start];
    while at != start {
        path.push(at.to_string());
        at = came_from[at];
    }
    path.push(start.to_string());
    path.reverse();
    path
}

// ---------------------------------------------------------------------------------------------
// Reading Rust.

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// A string literal's text between its quotes, escapes as written.
    Str(String),
    /// `::` or one character of punctuation.
    Punct(String),
}

#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    line: usize,
}

/// Splits Rust source into identifiers, string literals and punctuation; comments, numbers,
/// char literals and lifetimes are dropped.
fn lex(src: &str) -> Vec<Token> {
    let s: Vec<char> = src.chars().collect();
    let at = |i: usize| s.get(i).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    // Counts the line breaks of `s[from..to]`.
    let breaks = |from: usize, to: usize| s[from..to].iter().filter(|c| **c == '\n').count();
    while i < s.len() {
        let c = s[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < s.len() && s[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let start = i;
            let mut depth = 0;
            loop {
                if at(i) == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if at(i) == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else if i >= s.len() {
                    break;
                } else {
                    i += 1;
                }
            }
            line += breaks(start, i.min(s.len()));
        } else if c == '"' {
            let end = string_end(&s, i + 1);
            out.push(Token {
                tok: Tok::Str(s[i + 1..end].iter().collect()),
                line,
            });
            line += breaks(i, end);
            i = end + 1;
        } else if c == '\'' {
            if at(i + 1) == '\\' {
                // An escaped char literal: up to the closing quote after the escape.
                i += 3;
                while i < s.len() && s[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime or a label: the name that follows is lexed as an identifier.
                i += 1;
            }
        } else if c == '_' || c.is_alphabetic() {
            let start = i;
            while i < s.len() && (s[i] == '_' || s[i].is_alphanumeric()) {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            let raw = matches!(word.as_str(), "r" | "br" | "cr");
            if raw && (at(i) == '"' || at(i) == '#') {
                let mut hashes = 0;
                while at(i + hashes) == '#' {
                    hashes += 1;
                }
                if at(i + hashes) == '"' {
                    let open = i + hashes + 1;
                    let mut end = open;
                    while end < s.len()
                        && !(s[end] == '"' && (1..=hashes).all(|h| at(end + h) == '#'))
                    {
                        end += 1;
                    }
                    out.push(Token {
                        tok: Tok::Str(s[open..end.min(s.len())].iter().collect()),
                        line,
                    });
                    line += breaks(start, end.min(s.len()));
                    i = end + 1 + hashes;
                    continue;
                }
                if word == "r" && hashes == 1 {
                    // A raw identifier, `r#type`.
                    i += 1;
                    let from = i;
                    while i < s.len() && (s[i] == '_' || s[i].is_alphanumeric()) {
                        i += 1;
                    }
                    out.push(Token {
                        tok: Tok::Ident(s[from..i].iter().collect()),
                        line,
                    });
                    continue;
                }
            }
            if matches!(word.as_str(), "b" | "c") && at(i) == '"' {
                continue; // the string itself is lexed next
            }
            if word == "b" && at(i) == '\'' {
                continue; // a byte literal, lexed next as a char literal
            }
            out.push(Token {
                tok: Tok::Ident(word),
                line,
            });
        } else if c.is_ascii_digit() {
            while i < s.len()
                && (s[i] == '_'
                    || s[i].is_alphanumeric()
                    || (s[i] == '.' && at(i + 1).is_ascii_digit()))
            {
                i += 1;
            }
        } else if c == ':' && at(i + 1) == ':' {
            out.push(Token {
                tok: Tok::Punct("::".into()),
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                tok: Tok::Punct(c.to_string()),
                line,
            });
            i += 1;
        }
    }
    out
}

/// The index of the quote closing a string whose text starts at `from`.
fn string_end(s: &[char], from: usize) -> usize {
    let mut i = from;
    while i < s.len() && s[i] != '"' {
        i += if s[i] == '\\' { 2 } else { 1 };
    }
    i.min(s.len())
}

/// The identifiers of the path that ends just before token `i` (`a::b::` before `c`).
fn path_before(tokens: &[Token], i: usize) -> Vec<&str> {
    let mut path = Vec::new();
    let mut j = i;
    while j >= 2 && tokens[j - 1].tok == Tok::Punct("::".into()) {
        let Tok::Ident(seg) = &tokens[j - 2].tok else {
            break;
        };
        path.push(seg.as_str());
        j -= 2;
    }
    path.reverse();
    path
}

/// Every path a `use` declaration brings in, its groups expanded (`use a::{b, c::d}` is `a::b`
/// and `a::c::d`), with the index of its `use`.
fn use_paths(tokens: &[Token]) -> Vec<(usize, Vec<String>)> {
    fn tree(tokens: &[Token], i: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
        let mut path = prefix;
        while let Some(t) = tokens.get(*i) {
            match &t.tok {
                Tok::Punct(p) if p == "::" => *i += 1,
                Tok::Punct(p) if p == "{" => {
                    *i += 1;
                    loop {
                        tree(tokens, i, path.clone(), out);
                        match tokens.get(*i).map(|t| &t.tok) {
                            Some(Tok::Punct(p)) if p == "," => *i += 1,
                            Some(Tok::Punct(p)) if p == "}" => {
                                *i += 1;
                                return;
                            }
                            _ => return,
                        }
                        if matches!(tokens.get(*i).map(|t| &t.tok), Some(Tok::Punct(p)) if p == "}")
                        {
                            *i += 1;
                            return;
                        }
                    }
                }
                Tok::Punct(p) if p == "*" => {
                    *i += 1;
                    path.push("*".into());
                    out.push(path);
                    return;
                }
                Tok::Ident(name) if name == "as" => *i += 2,
                Tok::Ident(name) => {
                    path.push(name.clone());
                    *i += 1;
                }
                _ => break,
            }
        }
        if !path.is_empty() {
            out.push(path);
        }
    }
    let mut out = Vec::new();
    for (k, t) in tokens.iter().enumerate() {
        if t.tok != Tok::Ident("use".into()) {
            continue;
        }
        let mut paths = Vec::new();
        let mut i = k + 1;
        tree(tokens, &mut i, Vec::new(), &mut paths);
        out.extend(paths.into_iter().map(|p| (k, p)));
    }
    out
}

/// The files a source file compiles in: `#[path = "…"]` and `include!` / `include_str!` /
/// `include_bytes!("…")`, each with its line.
fn included_files(tokens: &[Token]) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        let Tok::Ident(name) = &t.tok else { continue };
        let window: Vec<&Tok> = tokens[i + 1..].iter().take(2).map(|t| &t.tok).collect();
        let target = match (name.as_str(), window.as_slice()) {
            ("path", [Tok::Punct(eq), Tok::Str(p)])
                if eq == "=" && i > 0 && tokens[i - 1].tok == Tok::Punct("[".into()) =>
            {
                Some(p)
            }
            ("include" | "include_str" | "include_bytes", [Tok::Punct(bang), Tok::Punct(open)])
                if bang == "!" && open == "(" =>
            {
                match tokens.get(i + 3).map(|t| &t.tok) {
                    Some(Tok::Str(p)) => Some(p),
                    _ => None,
                }
            }
            _ => None,
        };
        if let Some(target) = target {
            out.push((t.line, target.clone()));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The reader itself, on the cases the checks rely on.

#[test]
fn the_lexer_skips_comments_and_char_literals_and_reads_raw_strings() {
    let src = r####"
        // use lapin::Connection;
        /* sqlx::query("SELECT 1") /* nested */ */
        let q = '"'; let l: &'static str = "lapin=warn";
        let s = r#"SELECT * FROM t"#;
        let t = "\
            UPDATE t SET x = 1";
        fn f<'a>(x: &'a str) {}
        use sqlx::{self, query as q};
    "####;
    let tokens = lex(src);
    let strings: Vec<&str> = tokens
        .iter()
        .filter_map(|t| match &t.tok {
            Tok::Str(s) => Some(s.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(strings.len(), 3, "{strings:?}");
    assert!(strings[0] == "lapin=warn" && !starts_with_sql(strings[0]));
    assert!(starts_with_sql(strings[1]) && starts_with_sql(strings[2]));
    assert!(!tokens.iter().any(|t| t.tok == Tok::Ident("lapin".into())));
    assert_eq!(
        use_paths(&tokens)
            .into_iter()
            .map(|(_, p)| p.join("::"))
            .collect::<Vec<_>>(),
        ["sqlx::self", "sqlx::query"]
    );
    let last = tokens.last().unwrap();
    assert_eq!(
        last.line, 9,
        "lines are counted through comments and strings"
    );
}

#[test]
fn paths_resolve_from_their_module_and_cycles_are_found() {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(file_module("lib.rs"), s(&[]));
    assert_eq!(file_module("db/mod.rs"), s(&["db"]));
    assert_eq!(file_module("state/failure.rs"), s(&["state", "failure"]));
    let at = s(&["state", "failure"]);
    assert_eq!(
        resolve(&at, &s(&["super", "super", "db", "x"])),
        Some(s(&["db", "x"]))
    );
    assert_eq!(
        resolve(&at, &s(&["super", "Status"])),
        Some(s(&["state", "Status"]))
    );
    assert_eq!(
        resolve(&at, &s(&["crate", "operation"])),
        Some(s(&["operation"]))
    );
    assert_eq!(resolve(&at, &s(&["sqlx", "PgPool"])), None);
    let mut g = Graph::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        g.entry(a.into())
            .or_default()
            .insert(b.into(), ("f".into(), 1));
    }
    assert_eq!(cycles(&g), vec![s(&["a", "b", "c", "a"])]);
    g.get_mut("c").unwrap().remove("a");
    assert!(cycles(&g).is_empty());
}

// ---------------------------------------------------------------------------------------------
// One door and one tenant rule (the application layer's).

/// The front ends: the HTTP API and console, and the command line.
const FRONT_END_DIRS: &[&str] = &["http/src", "src"];

/// The front ends reach PostgreSQL only through `agentq-app`: no file of theirs names
/// `agentq_core::db`, in a path or a `use`.
#[test]
fn the_front_ends_name_no_core_db() {
    let mut findings = Vec::new();
    for file in rust_files(FRONT_END_DIRS) {
        let tokens = lex(&read(&file));
        for (i, t) in tokens.iter().enumerate() {
            if t.tok == Tok::Ident("db".into()) && path_before(&tokens, i) == ["agentq_core"] {
                findings.push(Finding::new(&file, t.line, "agentq_core::db"));
            }
        }
        for (at, path) in use_paths(&tokens) {
            if path.len() >= 2 && path[0] == "agentq_core" && path[1] == "db" {
                findings.push(Finding::new(&file, tokens[at].line, "use agentq_core::db"));
            }
        }
    }
    assert_allowed("agentq_core::db in a front end", findings, &[]);
}

/// Reads of a caller's tenant outside `Caller`'s own rule that are tolerated.
const TENANT_READS_ALLOWED: &[Allowed] = &[
    Allowed {
        file: "http/src/auth.rs",
        found: "caller.tenant",
        why: "the HTTP caller is built from the application layer's, field by field",
    },
    Allowed {
        file: "http/src/ui/session.rs",
        found: "caller.tenant",
        why: "the sign-in log line names the tenant",
    },
];

/// One tenant rule: which tenant a caller acts on is decided by `Caller::tenant` (and its two
/// forms, `tenant_filter` and `tenant_for_write`) in `app/src/caller.rs` only. Elsewhere in the
/// application layer and the front ends nothing reads a caller's `tenant` field, compares its
/// role with `Role::Admin`, or tests its `scope()`; `scope()` is only passed on, to confine a
/// lookup by id.
#[test]
fn one_tenant_rule() {
    let mut findings = Vec::new();
    let dirs: Vec<&str> = FRONT_END_DIRS.iter().copied().chain(["app/src"]).collect();
    for file in rust_files(&dirs) {
        if file == "app/src/caller.rs" {
            continue;
        }
        let tokens = lex(&read(&file));
        let tok = |i: usize| tokens.get(i).map(|t| &t.tok);
        let ident = |i: usize, s: &str| tok(i) == Some(&Tok::Ident(s.into()));
        let punct = |i: usize, s: &str| tok(i) == Some(&Tok::Punct(s.into()));
        for (i, t) in tokens.iter().enumerate() {
            let line = t.line;
            // `caller.tenant`, a field (not `caller.tenant(…)` nor `caller.tenant_filter`).
            if ident(i, "caller")
                && punct(i + 1, ".")
                && ident(i + 2, "tenant")
                && !punct(i + 3, "(")
            {
                findings.push(Finding::new(&file, line, "caller.tenant"));
            }
            // `….role == Role::Admin` / `!=`.
            if ident(i, "role")
                && i > 0
                && punct(i - 1, ".")
                && (punct(i + 1, "=") || punct(i + 1, "!"))
                && punct(i + 2, "=")
                && ident(i + 3, "Role")
                && ident(i + 5, "Admin")
            {
                findings.push(Finding::new(&file, line, "role compared with Role::Admin"));
            }
            // `scope()` tested rather than passed on.
            if ident(i, "scope") && punct(i + 1, "(") && punct(i + 2, ")") {
                let tested = (punct(i + 3, ".") && !ident(i + 4, "map_or"))
                    || ((punct(i + 3, "=") || punct(i + 3, "!")) && punct(i + 4, "="));
                if tested {
                    findings.push(Finding::new(&file, line, "scope() tested"));
                }
            }
        }
    }
    assert_allowed(
        "a tenant decided outside Caller::tenant",
        findings,
        TENANT_READS_ALLOWED,
    );
}

/// The longest a source file may be: past it, a file is doing more than one job.
const MAX_FILE_LINES: usize = 800;

#[test]
fn no_source_file_is_over_800_lines() {
    let crates = [
        "src",
        "core",
        "producer",
        "worker",
        "scheduler",
        "app",
        "http",
        "kinds",
        "bench",
        "testkit",
        "examples",
    ];
    let long: Vec<String> = rust_files(&crates)
        .into_iter()
        // Tests: a crate's `tests/` and a module's `tests.rs` (its `#[cfg(test)] mod tests`).
        .filter(|f| {
            !f.split('/')
                .any(|part| part == "tests" || part == "tests.rs")
        })
        .filter_map(|f| {
            let lines = read(&f).lines().count();
            (lines > MAX_FILE_LINES).then(|| format!("{f}: {lines} lines"))
        })
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_FILE_LINES} lines (split them along their seams): {long:?}"
    );
}

/// `package`'s normal dependencies without features, one crate a line (`name vX.Y.Z`), as
/// `cargo tree` resolves them from the lock file.
fn normal_dependencies(package: &str) -> String {
    let out = std::process::Command::new(env!("CARGO"))
        .current_dir(root())
        .args(["tree", "-p", package, "-e", "normal", "--prefix", "none"])
        .args(["--locked", "--offline", "--no-dedupe"])
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A deployment's binary links no benchmark and no test kit: the `agentq` library's normal
/// dependencies, without features, name neither `agentq-bench` (and its fake model server)
/// nor `agentq-testkit` (`agentq bench` is the `bench` feature of agentq's own binary).
#[test]
fn the_library_links_no_bench_or_test_kit() {
    let tree = normal_dependencies("agentq");
    assert!(tree.lines().count() > 50, "a whole tree: {tree}");
    let linked: Vec<&str> = tree
        .lines()
        .filter(|l| l.starts_with("agentq-bench ") || l.starts_with("agentq-testkit "))
        .collect();
    assert!(linked.is_empty(), "the library links {linked:?}");
}

/// What a kind sees (`agentq-sdk`) is not the engine: its sources name no `sqlx`, no `lapin`
/// and no `agentq_core::db` (nor `core::db` through a `use agentq_core::{db, …}`), and nothing
/// it depends on is a database, broker or HTTP client (`agentq-core` without its `engine`
/// feature is only shared types).
#[test]
fn the_sdk_names_no_database_or_broker() {
    let mut findings = Vec::new();
    let files = rust_files(&["sdk/rust"]);
    assert!(files.len() >= 5, "the SDK's sources: {files:?}");
    for file in files {
        let tokens = lex(&read(&file));
        for (i, t) in tokens.iter().enumerate() {
            let Tok::Ident(name) = &t.tok else { continue };
            if name == "sqlx" || name == "lapin" {
                findings.push(Finding::new(&file, t.line, name));
            }
            let after_core = i >= 2
                && tokens[i - 1].tok == Tok::Punct("::".into())
                && tokens[i - 2].tok == Tok::Ident("agentq_core".into());
            if name == "db" && after_core {
                findings.push(Finding::new(&file, t.line, "agentq_core::db"));
            }
        }
        for (line, path) in use_paths(&tokens) {
            if path.first().map(String::as_str) == Some("agentq_core")
                && path.get(1).map(String::as_str) == Some("db")
            {
                findings.push(Finding::new(&file, line, "use agentq_core::db"));
            }
        }
    }
    let tree = normal_dependencies("agentq-sdk");
    assert!(tree.lines().count() > 20, "a whole tree: {tree}");
    for client in ["sqlx", "lapin", "reqwest", "tokio"] {
        if let Some(line) = tree.lines().find(|l| l.starts_with(&format!("{client} "))) {
            findings.push(Finding::new("sdk/rust/Cargo.toml", 0, line));
        }
    }
    assert_allowed("the engine's clients in the SDK", findings, &[]);
}
