//! Times and durations as people type them (CLI flags, query parameters, form fields), parsed
//! with checked arithmetic and bounded, so a typo is refused by name and never panics.

use chrono::{DateTime, Datelike, Utc};

/// Parses a point in time given as RFC 3339, or as a duration (`90s`, `30m`, `2h`, `3d`) from
/// now into the future (`ahead`) or the past. `what` names the flag or field in the error,
/// which says what to give instead. Only the years 1970–9999 are accepted: the years
/// PostgreSQL, chrono and a person all agree on; a moment outside is a typo.
pub fn parse_moment(s: &str, what: &str, ahead: bool) -> Result<DateTime<Utc>, String> {
    let in_range = |t: DateTime<Utc>| (1970..=9999).contains(&t.year());
    let far = || format!("{what} {s:?} is outside the years 1970–9999: give a nearer time");
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        let t = t.with_timezone(&Utc);
        return if in_range(t) { Ok(t) } else { Err(far()) };
    }
    let secs = match seconds(s) {
        Some(Ok(secs)) => secs,
        Some(Err(())) => return Err(far()),
        None => {
            return Err(format!(
                "{what} {s:?}: use RFC 3339 or a duration like 90s, 30m, 2h, 7d"
            ));
        }
    };
    let now = Utc::now();
    chrono::Duration::try_seconds(secs)
        .and_then(|d| {
            if ahead {
                now.checked_add_signed(d)
            } else {
                now.checked_sub_signed(d)
            }
        })
        .filter(|t| in_range(*t))
        .ok_or_else(far)
}

/// A duration as typed (`90s`, `30m`, `2h`, `7d`) in seconds: `None` when it is not one,
/// `Some(Err(()))` when its number overflows.
fn seconds(s: &str) -> Option<Result<i64, ()>> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let unit_secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return None,
    };
    if num.is_empty() {
        return None;
    }
    Some(
        num.parse::<i64>()
            .ok()
            .and_then(|n| n.checked_mul(unit_secs))
            .ok_or(()),
    )
}

/// A duration as people type it (`90s`, `30m`, `2h`, `7d`), in seconds; `what` names the flag
/// or field in the error.
pub fn parse_duration(s: &str, what: &str) -> Result<i64, String> {
    match seconds(s.trim()) {
        Some(Ok(secs)) => Ok(secs),
        Some(Err(())) => Err(format!("{what} {s:?} is too long")),
        None => Err(format!(
            "{what} {s:?}: use a duration like 90s, 30m, 2h, 7d"
        )),
    }
}

/// A point in the past: RFC 3339, or a duration ago (30m, 2h, 7d).
pub fn parse_since(s: &str, what: &str) -> Result<DateTime<Utc>, String> {
    parse_moment(s, what, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments_are_durations_or_rfc_3339_within_1970_to_9999() {
        assert!(parse_since("2h", "since").unwrap() < Utc::now());
        assert!(parse_moment("2h", "deadline", true).unwrap() > Utc::now());
        assert!(parse_since("2026-01-01T00:00:00Z", "since").is_ok());
        for (s, says) in [
            ("2 weeks", "use RFC 3339"),
            ("100000000d", "outside the years"),
            ("99999999999999999999999d", "outside the years"),
            ("0001-01-01T00:00:00Z", "outside the years"),
            ("", "use RFC 3339"),
            ("-5m", "use RFC 3339"),
        ] {
            let e = parse_since(s, "--since").unwrap_err();
            assert!(e.contains(says) && e.starts_with("--since"), "{s:?}: {e}");
        }
    }

    #[test]
    fn durations_are_whole_units() {
        assert_eq!(parse_duration("90s", "--every"), Ok(90));
        assert_eq!(parse_duration("2h", "--every"), Ok(7200));
        assert_eq!(parse_duration(" 7d ", "--every"), Ok(604_800));
        for (s, says) in [
            ("1.5h", "use a duration"),
            ("h", "use a duration"),
            ("10", "use a duration"),
            ("-1s", "use a duration"),
            ("99999999999999999999d", "too long"),
        ] {
            let e = parse_duration(s, "--every").unwrap_err();
            assert!(e.contains(says) && e.starts_with("--every"), "{s:?}: {e}");
        }
    }
}
