//! The model step's text handling: a document cut into chunks the model takes one at a time
//! (put back together exactly), and the confidence line each answer ends with.

/// A piece of the document sent to the model on its own: `body` goes to the model, the
/// whitespace around it (`lead`, `tail`) is kept as it is, so the pieces of a document put
/// back together are the document, and an answer's surrounding whitespace does not matter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chunk<'a> {
    pub lead: &'a str,
    pub body: &'a str,
    pub tail: &'a str,
}

/// Splits `text` into chunks whose bodies have at most `max_chars` characters: cut after
/// paragraph breaks (`\n\n`) where possible; a paragraph longer than that is cut at its last
/// line break or whitespace in the window (if that keeps at least half of it), else at the
/// limit, always on a character boundary. Whitespace-only pieces join their neighbours.
pub(crate) fn split_chunks(text: &str, max_chars: usize) -> Vec<Chunk<'_>> {
    let max = max_chars.max(1);
    let mut slices: Vec<(usize, usize)> = Vec::new();
    let (mut start, mut chars, mut pos) = (0, 0, 0);
    for para in text.split_inclusive("\n\n") {
        let n = para.chars().count();
        let end = pos + para.len();
        if chars + n <= max {
            chars += n;
            pos = end;
            continue;
        }
        if chars > 0 {
            slices.push((start, pos));
            start = pos;
        }
        let mut rest = n;
        while rest > max {
            let cut = hard_cut(text, start, max);
            rest -= text[start..cut].chars().count();
            slices.push((start, cut));
            start = cut;
        }
        chars = rest;
        pos = end;
    }
    if start < text.len() {
        slices.push((start, text.len()));
    }

    // [start, body start, body end, end] of each chunk.
    let mut spans: Vec<[usize; 4]> = Vec::new();
    let mut pending_lead: Option<usize> = None;
    for (a, b) in slices {
        let slice = &text[a..b];
        let body_start = a + (slice.len() - slice.trim_start().len());
        let body_end = a + slice.trim_end().len();
        if body_start >= body_end {
            match spans.last_mut() {
                Some(last) => last[3] = b,
                None => {
                    pending_lead.get_or_insert(a);
                }
            }
            continue;
        }
        spans.push([pending_lead.take().unwrap_or(a), body_start, body_end, b]);
    }
    spans
        .into_iter()
        .map(|[s, bs, be, e]| Chunk {
            lead: &text[s..bs],
            body: &text[bs..be],
            tail: &text[be..e],
        })
        .collect()
}

/// Where to cut a piece starting at `start` that is longer than `max` characters.
fn hard_cut(text: &str, start: usize, max: usize) -> usize {
    let limit = text[start..]
        .char_indices()
        .nth(max)
        .map_or(text.len(), |(i, _)| start + i);
    let window = &text[start..limit];
    let half = window.len() / 2;
    if let Some(i) = window.rfind('\n').filter(|&i| i + 1 >= half) {
        return start + i + 1;
    }
    if let Some((i, c)) = window
        .char_indices()
        .rev()
        .find(|(_, c)| c.is_whitespace())
        .filter(|&(i, _)| i + 1 >= half)
    {
        return start + i + c.len_utf8();
    }
    limit
}

/// Splits a chunk's answer into its text and the confidence of a trailing
/// `confidence: <0..1>` line (1.0 without one). A confidence line whose value is not a number
/// from 0 to 1 counts as 0: the model tried to say something about its certainty and failed.
pub(crate) fn strip_confidence(answer: &str) -> (&str, f64) {
    let trimmed = answer.trim_end();
    let (rest, last) = match trimmed.rfind('\n') {
        Some(i) => (&trimmed[..i], &trimmed[i + 1..]),
        None => ("", trimmed),
    };
    match confidence_value(last) {
        Some(c) => (rest.trim(), c),
        None => (answer.trim(), 1.0),
    }
}

fn confidence_value(line: &str) -> Option<f64> {
    let markup = |c: char| c == '*' || c == '`' || c == '_' || c.is_whitespace();
    let line = line.trim_matches(markup);
    let label = line.get(..11)?;
    if !label.eq_ignore_ascii_case("confidence:") {
        return None;
    }
    let value = line[11..].trim_matches(markup);
    let value = value.strip_suffix('.').unwrap_or(value);
    Some(match value.parse::<f64>() {
        Ok(c) if (0.0..=1.0).contains(&c) => c,
        _ => 0.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn joined(chunks: &[Chunk<'_>]) -> String {
        chunks
            .iter()
            .map(|c| format!("{}{}{}", c.lead, c.body, c.tail))
            .collect()
    }

    #[test]
    fn chunks_cut_after_paragraphs_and_put_back_together_exactly() {
        let text = "Title: one\n\nfirst paragraph\n\nsecond paragraph\n\n\n\nthird\n";
        let one = split_chunks(text, 8000);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].body, text.trim());
        assert_eq!(one[0].tail, "\n");

        let many = split_chunks(text, 20);
        assert_eq!(
            many.iter().map(|c| c.body).collect::<Vec<_>>(),
            ["Title: one", "first paragraph", "second paragraph", "third"]
        );
        assert_eq!(many[0].tail, "\n\n");
        assert_eq!(joined(&many), text);

        // Paragraphs that fit together share a chunk.
        let two = split_chunks("aa\n\nbb\n\ncc\n\ndd", 8);
        assert_eq!(
            two.iter().map(|c| c.body).collect::<Vec<_>>(),
            ["aa\n\nbb", "cc\n\ndd"]
        );
    }

    #[test]
    fn chunk_bodies_never_exceed_the_limit_nor_split_a_character() {
        let samples = [
            "é".repeat(50),
            "日本語のテキスト。".repeat(20),
            format!("{}\n\n{}", "word ".repeat(100), "🦀".repeat(33)),
            "  \n\n  leading whitespace\n\n\n\n   \n\ntrailing   \n\n".to_string(),
            "x".repeat(1000),
            "line one\nline two\nline three\n".repeat(40),
        ];
        for text in &samples {
            for max in [1, 2, 3, 7, 16, 64, 100, 8000] {
                let chunks = split_chunks(text, max);
                assert_eq!(&joined(&chunks), text, "max {max}");
                for c in &chunks {
                    assert!(c.body.chars().count() <= max, "max {max}: {:?}", c.body);
                    assert!(!c.body.trim().is_empty());
                    assert_eq!(c.body, c.body.trim());
                    assert!(c.lead.trim().is_empty() && c.tail.trim().is_empty());
                }
            }
        }
        // A long paragraph is cut at whitespace, not inside a word.
        let text = "word ".repeat(100);
        let words = split_chunks(&text, 64);
        assert!(words.iter().all(|c| c.body.split(' ').all(|w| w == "word")));
        // Without whitespace, at the limit: 3 crabs (4 bytes each) per chunk.
        let text = "🦀".repeat(7);
        let crabs = split_chunks(&text, 3);
        assert_eq!(
            crabs.iter().map(|c| c.body).collect::<Vec<_>>(),
            ["🦀🦀🦀", "🦀🦀🦀", "🦀"]
        );
        assert!(split_chunks(" \n\n \n", 10).is_empty());
    }

    #[test]
    fn a_trailing_confidence_line_is_parsed_and_stripped() {
        assert_eq!(strip_confidence("text"), ("text", 1.0));
        assert_eq!(
            strip_confidence("line 1\nline 2\nconfidence: 0.25\n"),
            ("line 1\nline 2", 0.25)
        );
        assert_eq!(strip_confidence("a\n\nConfidence: 1"), ("a", 1.0));
        assert_eq!(strip_confidence("a\n**Confidence:** 0.7."), ("a", 0.7));
        assert_eq!(strip_confidence("a\nconfidence: high"), ("a", 0.0));
        assert_eq!(strip_confidence("a\nconfidence: 7"), ("a", 0.0));
        assert_eq!(strip_confidence("confidence: 0.9"), ("", 0.9));
        // Only the last line counts.
        assert_eq!(
            strip_confidence("confidence: 0.1\nbody"),
            ("confidence: 0.1\nbody", 1.0)
        );
        assert_eq!(strip_confidence("  text  \n"), ("text", 1.0));
        assert_eq!(
            strip_confidence("naïve\nconfidenc"),
            ("naïve\nconfidenc", 1.0)
        );
    }
}
