//! Versions of a kind: the string an author bumps when a kind's step sequence changes.
//!
//! Versions are ordered so that every process agrees which one is the newest: they compare in
//! natural order, runs of digits as numbers and the rest as text (`"2" < "10"`,
//! `"2026-11-30" < "2026-12-01"`, `"1.9" < "1.10"`). A git hash has no such order: name versions
//! by a number or a date.

use std::cmp::Ordering;

/// The version a kind registered without one has.
pub const DEFAULT: &str = "1";

/// Longest version string.
pub const MAX_LEN: usize = 64;

/// Checks a version string: 1–64 characters of `A–Z a–z 0–9 . _ -`.
pub fn check(version: &str) -> Result<(), String> {
    if version.is_empty() || version.len() > MAX_LEN {
        return Err(format!(
            "a kind version has 1 to {MAX_LEN} characters; {version:?} has {}",
            version.len()
        ));
    }
    if let Some(c) = version
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "a kind version takes letters, digits, '.', '_' and '-' only; {version:?} has {c:?}"
        ));
    }
    Ok(())
}

/// Natural order of two versions: runs of digits compare as numbers (leading zeros aside),
/// everything else byte by byte; equal runs move on to the next.
pub fn compare(a: &str, b: &str) -> Ordering {
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    loop {
        match (a.first(), b.first()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let (na, ra) = split_digits(a);
                let (nb, rb) = split_digits(b);
                let (na, nb) = (trim_zeros(na), trim_zeros(nb));
                let by_number = na.len().cmp(&nb.len()).then_with(|| na.cmp(nb));
                if by_number != Ordering::Equal {
                    return by_number;
                }
                (a, b) = (ra, rb);
            }
            (Some(x), Some(y)) => {
                if x != y {
                    return x.cmp(y);
                }
                (a, b) = (&a[1..], &b[1..]);
            }
        }
    }
}

/// The newest of `versions` in [`compare`]'s order.
pub fn newest<'a>(versions: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    versions.into_iter().max_by(|a, b| compare(a, b))
}

fn split_digits(s: &[u8]) -> (&[u8], &[u8]) {
    let n = s.iter().take_while(|c| c.is_ascii_digit()).count();
    s.split_at(n)
}

fn trim_zeros(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|c| **c == b'0').count();
    &s[n..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_compare_in_natural_order() {
        let ordered = [
            "1",
            "1.2",
            "1.10",
            "2",
            "2-beta",
            "10",
            "2026-11-30",
            "2026-12-01",
            "a",
            "v2",
            "v10",
        ];
        for (i, a) in ordered.iter().enumerate() {
            for (j, b) in ordered.iter().enumerate() {
                assert_eq!(compare(a, b), i.cmp(&j), "{a} vs {b}");
            }
        }
        assert_eq!(compare("007", "7"), Ordering::Equal);
        // A number longer than any integer type still compares.
        assert_eq!(
            compare(
                "99999999999999999999999999999",
                "100000000000000000000000000000"
            ),
            Ordering::Less
        );
        assert_eq!(newest(["3", "20", "4"]), Some("20"));
        assert_eq!(newest([]), None);
    }

    #[test]
    fn version_strings_are_checked() {
        assert!(check("1").is_ok());
        assert!(check("2026-12-01_b.3").is_ok());
        assert!(check("").is_err());
        assert!(check(&"9".repeat(65)).is_err());
        let refused = check("v 2").unwrap_err();
        assert!(refused.contains("' '"), "{refused}");
        assert!(check("1@2").is_err(), "'@' is not a version character");
    }
}
