//! The named transitions against the table, their SQL spellings against their values, and every
//! status writer of `db` and of the migrations against the named transitions.

use std::path::{Path, PathBuf};

use super::*;
use crate::state::can_transition;

#[test]
fn every_transition_is_in_the_table_and_named_once() {
    let mut names = Vec::new();
    for t in ALL {
        assert!(!t.from.is_empty(), "{} starts from nothing", t.name);
        for &from in t.from {
            assert!(
                can_transition(from, t.to),
                "{}: {from} → {} is not in the table",
                t.name,
                t.to
            );
        }
        assert!(!names.contains(&t.name), "{} is named twice", t.name);
        names.push(t.name);
    }
}

/// Checks, for each const named, its name, its `from_sql!` and `to_sql!`; returns the consts.
macro_rules! spelled {
    ($($name:ident),+ $(,)?) => {{
        $(
            assert_eq!($name.name, stringify!($name).to_lowercase());
            assert_eq!(from_sql!($name), $name.from_sql(), "from_sql!({})", stringify!($name));
            assert_eq!(to_sql!($name), $name.to_sql(), "to_sql!({})", stringify!($name));
        )+
        vec![$($name),+]
    }};
}

#[test]
fn the_sql_of_each_transition_is_its_value() {
    let checked = spelled!(
        CLAIM,
        COMPLETE,
        FAIL_RETRY,
        FAIL_DEAD,
        FAIL_CANCEL,
        PARK_SLEEP,
        PARK_WAIT,
        WAKE,
        SIGNAL,
        BUDGET,
        REAP,
        CRASH_LOOP,
        RELEASE,
        HAND_BACK,
        CANCEL,
        CASCADE,
        EXPIRE,
        RETRY,
        DISCARD,
    );
    assert_eq!(checked, ALL, "a transition of ALL is not checked here");
}

/// Where the SQL of one `UPDATE operations` sits, and what it writes.
#[derive(Debug)]
struct Writer {
    at: String,
    /// The transitions the statement names in its `SET status = …` (`to_sql!`) or by const.
    named: Vec<Transition>,
    /// The transitions whose from-set the statement's item guards with (`from_sql!`).
    guards: Vec<Transition>,
    /// What is wrong with it, if anything.
    problems: Vec<String>,
}

fn by_name(name: &str) -> Option<Transition> {
    ALL.iter().copied().find(|t| t.name == name.to_lowercase())
}

/// The names in `text` of every `macro!(NAME)` call.
fn macro_args(text: &str, mac: &str) -> Vec<String> {
    let open = format!("{mac}!(");
    text.match_indices(&open)
        .map(|(i, _)| {
            let rest = &text[i + open.len()..];
            rest[..rest.find(')').unwrap_or(rest.len())]
                .trim()
                .to_string()
        })
        .collect()
}

/// Whether `text` writes `status` in an SQL `SET` list: `status =` not part of a longer
/// identifier (`o.status`, `status_before`…).
fn assigns_status(set: &str) -> bool {
    set.match_indices("status").any(|(i, _)| {
        let before = set[..i].chars().next_back();
        let after = set[i + "status".len()..].trim_start();
        !matches!(before, Some(c) if c.is_alphanumeric() || c == '_' || c == '.')
            && after.starts_with('=')
            && !after.starts_with("==")
    })
}

/// The `SET` list of the `UPDATE operations` at `at` in `text`: up to its `FROM` or `WHERE`.
fn set_list(text: &str, at: usize) -> &str {
    let rest = &text[at..];
    let end = ["WHERE", "FROM"]
        .iter()
        .filter_map(|k| rest.find(k))
        .min()
        .unwrap_or(rest.len());
    &rest[..end]
}

/// The value a `SET` list assigns to `status`: up to the next comma, or a `CASE`'s `END`.
fn status_value(set: &str) -> &str {
    let Some(at) = set.find("status =") else {
        return "";
    };
    let value = set[at + "status =".len()..].trim_start();
    let end = if value.starts_with("CASE") {
        value.find("END").unwrap_or(value.len())
    } else {
        value.find(',').unwrap_or(value.len())
    };
    &value[..end]
}

/// Every status literal (`'queued'`…) in `text`.
fn status_literals(text: &str) -> Vec<&'static str> {
    Status::NAMES
        .iter()
        .copied()
        .filter(|n| text.contains(&format!("'{n}'")))
        .collect()
}

/// The top-level items (functions, consts…) of a Rust file, as (first line, text): an item
/// starts at a line with no indentation that begins one.
fn items(src: &str) -> Vec<(usize, String)> {
    let starts = [
        "pub ",
        "async ",
        "fn ",
        "const ",
        "macro_rules!",
        "impl",
        "struct ",
        "enum ",
        "mod ",
        "#[cfg(test)]",
    ];
    let mut out: Vec<(usize, String)> = Vec::new();
    for (n, line) in src.lines().enumerate() {
        if out.is_empty() || starts.iter().any(|s| line.starts_with(s)) {
            out.push((n + 1, String::new()));
        }
        let item = &mut out.last_mut().unwrap().1;
        item.push_str(line);
        item.push('\n');
    }
    out
}

/// Every status writer of a Rust file of `db`: each `UPDATE operations` whose `SET` writes
/// `status`, with the transitions its item names.
fn rust_writers(file: &str, src: &str) -> Vec<Writer> {
    let mut out = Vec::new();
    for (line, item) in items(src) {
        if item.starts_with("#[cfg(test)]") {
            continue;
        }
        for (at, _) in item.match_indices("UPDATE operations") {
            let set = set_list(&item, at);
            if !assigns_status(set) {
                continue;
            }
            let mut problems = Vec::new();
            let mut named: Vec<Transition> = Vec::new();
            for name in macro_args(set, "to_sql") {
                match by_name(&name) {
                    Some(t) => named.push(t),
                    None => problems.push(format!("to_sql!({name}) names no transition")),
                }
            }
            // A status bound as a parameter names its transitions by const in the item.
            if set.contains("status = $") {
                named.extend(ALL.iter().copied().filter(|t| {
                    let c = t.name.to_uppercase();
                    item.match_indices(&c).any(|(i, _)| {
                        let after = item[i + c.len()..].chars().next();
                        let before = item[..i].chars().next_back();
                        !matches!(after, Some(ch) if ch.is_alphanumeric() || ch == '_')
                            && !matches!(before, Some(ch) if ch.is_alphanumeric() || ch == '_')
                    })
                }));
            }
            let literals = status_literals(status_value(set));
            if !literals.is_empty() {
                problems.push(format!(
                    "its SET spells statuses {literals:?}: take them from `to_sql!`"
                ));
            }
            if named.is_empty() {
                problems.push("names no transition".into());
            }
            let guards = macro_args(&item, "from_sql")
                .iter()
                .filter_map(|n| by_name(n))
                .collect();
            let line = line + item[..at].lines().count().saturating_sub(1);
            out.push(Writer {
                at: format!("{file}:{line}"),
                named,
                guards,
                problems,
            });
        }
    }
    out
}

/// The name of the function a migration's statement at `at` belongs to, if any.
fn function_at(sql: &str, at: usize) -> Option<String> {
    let before = &sql[..at];
    let start = before.rfind("FUNCTION ")?;
    // Past the function's closing `$$`, the statement is not in it.
    let body = &before[start..];
    if body.matches("$$").count() != 1 {
        return None;
    }
    let name = &body["FUNCTION ".len()..];
    Some(name[..name.find('(')?].trim().to_string())
}

/// Every status writer of a migration: each `UPDATE operations` whose `SET` writes `status`,
/// which must be a registered trigger's, spelling its transition.
fn migration_writers(file: &str, sql: &str) -> Vec<Writer> {
    let mut out = Vec::new();
    for (at, _) in sql.match_indices("UPDATE operations") {
        let set = set_list(sql, at);
        if !assigns_status(set) {
            continue;
        }
        let line = sql[..at].lines().count() + 1;
        let mut w = Writer {
            at: format!("{file}:{line}"),
            named: Vec::new(),
            guards: Vec::new(),
            problems: Vec::new(),
        };
        let function = function_at(sql, at);
        match TRIGGERS
            .iter()
            .find(|(name, _)| Some(*name) == function.as_deref())
        {
            None => w.problems.push(format!(
                "writes status in {function:?}, which is not in `transition::TRIGGERS`"
            )),
            Some((_, t)) => {
                w.named.push(*t);
                let statement = &sql[at..at + sql[at..].find(';').unwrap_or(sql.len() - at)];
                if !set.contains(&format!("status = {}", t.to_sql())) {
                    w.problems
                        .push(format!("its SET does not write {}", t.to_sql()));
                }
                let guard = match t.from {
                    [one] => format!("status = '{one}'"),
                    _ => format!("status IN {}", t.from_sql()),
                };
                if statement.contains(&guard) {
                    w.guards.push(*t);
                }
            }
        }
        out.push(w);
    }
    out
}

fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, ext, out);
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
}

/// Checks the writers: each names a transition, is guarded by that transition's from-set, and
/// (checked above) every transition is in the table. Returns the problems found.
fn problems(writers: &[Writer]) -> Vec<String> {
    let mut out = Vec::new();
    for w in writers {
        for p in &w.problems {
            out.push(format!("{}: {p}", w.at));
        }
        for t in &w.named {
            if !w.guards.iter().any(|g| g.from == t.from) {
                out.push(format!(
                    "{}: writes {} ({}) without the guard `status IN {}` (from_sql!)",
                    w.at,
                    t.to,
                    t.name,
                    t.from_sql()
                ));
            }
        }
    }
    out
}

#[test]
fn every_status_writer_names_its_transition() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut writers = Vec::new();
    let mut rust = Vec::new();
    files(&root.join("src/db"), "rs", &mut rust);
    for path in rust {
        let src = std::fs::read_to_string(&path).unwrap();
        let file = path.strip_prefix(root).unwrap().display().to_string();
        writers.extend(rust_writers(&file, &src));
    }
    let mut sql = Vec::new();
    files(&root.join("../migrations"), "sql", &mut sql);
    for path in sql {
        let src = std::fs::read_to_string(&path).unwrap();
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        writers.extend(migration_writers(&file, &src));
    }
    let found = problems(&writers);
    assert!(
        found.is_empty(),
        "status writers that do not follow a named transition (name it in \
         `core::state::transition` and build its SQL from `from_sql!`/`to_sql!`):\n{}",
        found.join("\n")
    );
    // Every transition has a writer, so none is named but never written.
    for t in ALL {
        assert!(
            writers.iter().any(|w| w.named.contains(t)),
            "no statement writes {}",
            t.name
        );
    }
}

#[test]
fn the_writer_scan_sees_an_unnamed_write() {
    let src = "pub async fn f() {\n    sqlx::query(\"UPDATE operations SET status = 'dead' WHERE id = $1\")\n}\n";
    let found = problems(&rust_writers("x.rs", src));
    assert!(found.len() == 2, "{found:?}");
    let src = "pub async fn f() {\n    sqlx::query(concat!(\"UPDATE operations o SET epoch = 1, status = \", to_sql!(EXPIRE), \" WHERE id = $1\"))\n}\n";
    let found = problems(&rust_writers("x.rs", src));
    assert!(found.len() == 1 && found[0].contains("guard"), "{found:?}");
    let sql = "CREATE FUNCTION f() RETURNS trigger AS $$ BEGIN UPDATE operations SET status = 'dead' WHERE id = 1; END $$";
    let found = problems(&migration_writers("x.sql", sql));
    assert!(
        found.len() == 1 && found[0].contains("TRIGGERS"),
        "{found:?}"
    );
}
