//! The guides' links resolve: every relative Markdown link `[text](target)` in README.md,
//! CONTRIBUTING.md, ARCHITECTURE.md, docs/*.md and sdk/python/README.md names a file that
//! exists (relative to the linking file), and a `#anchor` names a heading of that file (its
//! GitHub slug). Links inside fenced code blocks and code spans are not links. And README.md
//! stays a short guide: at most 200 lines, the rest in docs/.
//!
//! Needs nothing but the checkout: no database, no broker.

use std::collections::HashSet;
use std::fs;
use std::path::{Component, Path, PathBuf};

/// The most lines README.md may have (`wc -l README.md`).
const README_MAX_LINES: usize = 200;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown files whose links are checked, relative to the repository root.
fn checked_files() -> Vec<PathBuf> {
    let root = root();
    let mut files: Vec<PathBuf> = ["README.md", "CONTRIBUTING.md", "ARCHITECTURE.md"]
        .iter()
        .map(PathBuf::from)
        .collect();
    let mut docs: Vec<PathBuf> = fs::read_dir(root.join("docs"))
        .expect("docs/ is readable")
        .map(|entry| entry.expect("a docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .map(|path| path.strip_prefix(&root).unwrap().to_path_buf())
        .collect();
    docs.sort();
    files.extend(docs);
    files.push(PathBuf::from("sdk/python/README.md"));
    files
}

/// A line that opens or closes a fenced code block: its fence character and length.
fn fence(line: &str) -> Option<(char, usize)> {
    let trimmed = line.trim_start();
    let c = trimmed.chars().next()?;
    if c != '`' && c != '~' {
        return None;
    }
    let len = trimmed.chars().take_while(|&x| x == c).count();
    (len >= 3).then_some((c, len))
}

/// `paragraph` with the contents of its code spans (and their backticks) blanked out, so that
/// what looks like a link inside one is not taken for a link. A backtick run that no run of the
/// same length closes is literal, as in CommonMark. Line breaks are kept.
fn blank_code_spans(paragraph: &str) -> String {
    let chars: Vec<char> = paragraph.chars().collect();
    let run_at = |i: usize| chars[i..].iter().take_while(|&&c| c == '`').count();
    let mut out: Vec<char> = chars.clone();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            i += 1;
            continue;
        }
        let run = run_at(i);
        // The closing run: the next run of exactly the same length.
        let mut j = i + run;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let other = run_at(j);
                if other == run {
                    close = Some(j);
                    break;
                }
                j += other;
            } else {
                j += 1;
            }
        }
        match close {
            Some(j) => {
                for c in &mut out[i..j + run] {
                    if *c != '\n' {
                        *c = ' ';
                    }
                }
                i = j + run;
            }
            None => i += run,
        }
    }
    out.into_iter().collect()
}

/// Follows fenced code blocks line by line (`open_fence`: the fence open now): whether `line`
/// is inside one, or opens or closes one.
fn fenced(open_fence: &mut Option<(char, usize)>, line: &str) -> bool {
    if let Some((c, len)) = *open_fence {
        if let Some((c2, len2)) = fence(line) {
            let rest = line.trim_start().trim_start_matches(c2);
            if c2 == c && len2 >= len && rest.trim().is_empty() {
                *open_fence = None;
            }
        }
        return true;
    }
    if let Some(f) = fence(line) {
        *open_fence = Some(f);
        return true;
    }
    false
}

/// The lines of `text` that are not inside a fenced code block, numbered from 1, with the
/// contents of code spans blanked out (a code span may run over several lines of a paragraph).
fn prose_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut paragraph: Vec<(usize, &str)> = Vec::new();
    let flush = |paragraph: &mut Vec<(usize, &str)>, out: &mut Vec<(usize, String)>| {
        let joined: Vec<&str> = paragraph.iter().map(|(_, line)| *line).collect();
        let blanked = blank_code_spans(&joined.join("\n"));
        for ((number, _), line) in paragraph.iter().zip(blanked.split('\n')) {
            out.push((*number, line.to_string()));
        }
        paragraph.clear();
    };
    let mut open_fence: Option<(char, usize)> = None;
    for (i, line) in text.lines().enumerate() {
        if fenced(&mut open_fence, line) {
            flush(&mut paragraph, &mut out);
            continue;
        }
        if line.trim().is_empty() {
            flush(&mut paragraph, &mut out);
            continue;
        }
        paragraph.push((i + 1, line));
    }
    flush(&mut paragraph, &mut out);
    out
}

/// The targets of the inline links and images on one line (code spans already blanked).
fn link_targets(line: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let before = &rest[..at];
        let after = &rest[at + 2..];
        rest = after;
        if !before.contains('[') {
            continue;
        }
        let target = if let Some(inner) = after.strip_prefix('<') {
            match inner.find('>') {
                Some(end) => &inner[..end],
                None => continue,
            }
        } else {
            // Up to the closing parenthesis (balancing inner ones) or a title after a space.
            let mut depth = 0usize;
            let mut end = None;
            for (k, c) in after.char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' if depth == 0 => {
                        end = Some(k);
                        break;
                    }
                    ')' => depth -= 1,
                    ' ' | '\t' => {
                        end = Some(k);
                        break;
                    }
                    _ => {}
                }
            }
            match end {
                Some(end) => &after[..end],
                None => continue,
            }
        };
        targets.push(target.to_string());
    }
    targets
}

fn is_external(target: &str) -> bool {
    let lower = target.to_ascii_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://") || lower.starts_with("mailto:")
}

/// GitHub's anchor for a heading: lowercase, spaces to '-', punctuation other than '-' and
/// '_' dropped (so `` `doc_migration` `` is `doc_migration`, "Why isn't it running?" is
/// `why-isnt-it-running`).
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// A heading's text as GitHub renders it for its slug: a link keeps only its text.
fn heading_text(raw: &str) -> String {
    let raw = raw.trim();
    // A closing sequence of '#'s is not part of the heading.
    let raw = match raw.trim_end_matches('#') {
        t if t.len() < raw.len() && (t.is_empty() || t.ends_with(' ')) => t.trim_end(),
        _ => raw,
    };
    let mut text = String::new();
    let mut rest = raw;
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](") else {
            break;
        };
        let Some(end) = rest[open + close..].find(')') else {
            break;
        };
        text.push_str(&rest[..open]);
        text.push_str(&rest[open + 1..open + close]);
        rest = &rest[open + close + end + 1..];
    }
    text.push_str(rest);
    text
}

/// The anchors GitHub gives the headings of a Markdown file (a repeated slug gets `-1`, `-2`, …).
fn anchors(text: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    let mut open_fence: Option<(char, usize)> = None;
    for line in text.lines() {
        if fenced(&mut open_fence, line) {
            continue;
        }
        let trimmed = line.trim_start();
        if line.len() - trimmed.len() > 3 {
            continue;
        }
        let hashes = trimmed.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) {
            continue;
        }
        let after = &trimmed[hashes..];
        if !(after.is_empty() || after.starts_with(' ') || after.starts_with('\t')) {
            continue;
        }
        let base = slug(&heading_text(after));
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// `path` relative to the repository root, with `.` and `..` resolved (for messages).
fn shown(path: &Path) -> String {
    let mut parts: Vec<&std::ffi::OsStr> = Vec::new();
    for part in path.components() {
        match part {
            Component::ParentDir if !parts.is_empty() => {
                parts.pop();
            }
            Component::CurDir => {}
            other => parts.push(other.as_os_str()),
        }
    }
    parts.iter().collect::<PathBuf>().display().to_string()
}

/// What is wrong with one link, if anything.
fn check(root: &Path, from: &Path, target: &str) -> Option<String> {
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let relative = if path.is_empty() {
        from.to_path_buf()
    } else {
        from.parent().unwrap().join(path)
    };
    let file = root.join(&relative);
    if !file.exists() {
        return Some(format!("{} does not exist", shown(&relative)));
    }
    let anchor = anchor?;
    if file.extension().is_none_or(|ext| ext != "md") {
        return Some(format!(
            "{}: an anchor on a file that is not Markdown",
            shown(&relative)
        ));
    }
    match fs::read_to_string(&file) {
        Ok(text) if anchors(&text).contains(anchor) => None,
        Ok(_) => Some(format!(
            "{} has no heading with the anchor #{anchor}",
            shown(&relative)
        )),
        Err(e) => Some(format!("{} cannot be read: {e}", shown(&relative))),
    }
}

#[test]
fn every_relative_link_resolves() {
    let root = root();
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in checked_files() {
        let text = match fs::read_to_string(root.join(&file)) {
            Ok(text) => text,
            Err(e) => {
                broken.push(format!("{}: cannot be read: {e}", file.display()));
                continue;
            }
        };
        for (line, prose) in prose_lines(&text) {
            for target in link_targets(&prose) {
                if is_external(&target) {
                    continue;
                }
                checked += 1;
                if let Some(why) = check(&root, &file, &target) {
                    broken.push(format!("{}:{line}: ({target}): {why}", file.display()));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "{} broken link(s) of {checked}:\n{}",
        broken.len(),
        broken.join("\n")
    );
    assert!(checked > 0, "no links found: is the parser broken?");
}

#[test]
fn readme_is_a_short_guide() {
    let readme = fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.bytes().filter(|&b| b == b'\n').count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move detail to a page under docs/"
    );
}

#[test]
fn the_parser_finds_links_and_anchors() {
    let text = "# Why isn't it running?\n## `doc_migration`\n## Beside X (bench/peers, 2026-12-05)\n\
                ## A\n## A\n```sh\n# not a heading\n[no](link.md)\n```\n\
                See [a](b.md#c) and `[code](x.md)` and ![img](p.png \"title\").\n\n\
                A `span\nover [two](lines.md)` lines, a lone ` backtick [d](e.md).\n";
    let anchors = anchors(text);
    for a in [
        "why-isnt-it-running",
        "doc_migration",
        "beside-x-benchpeers-2026-12-05",
        "a",
        "a-1",
    ] {
        assert!(anchors.contains(a), "{a} in {anchors:?}");
    }
    assert!(!anchors.contains("not-a-heading"));
    let targets: Vec<String> = prose_lines(text)
        .iter()
        .flat_map(|(_, line)| link_targets(line))
        .collect();
    assert_eq!(targets, ["b.md#c", "p.png", "e.md"]);
}
