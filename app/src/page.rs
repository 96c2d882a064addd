//! Keyset pages, as every list of the application layer serves them (the DLQ, operations):
//! newest first by `(created_at, id)`, at most [`MAX_PAGE`] items, continued after an opaque
//! cursor that names the last item of the previous page.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{AppError, Result};

/// Most items one page lists.
pub const MAX_PAGE: i64 = 1000;

/// Where a page continues: after this `(created_at, id)`.
pub type After = Option<(DateTime<Utc>, Uuid)>;

/// Refuses a page size outside 1–[`MAX_PAGE`], naming `limit`.
pub fn check_limit(limit: i64) -> Result<()> {
    if (1..=MAX_PAGE).contains(&limit) {
        Ok(())
    } else {
        Err(AppError::malformed(
            "limit",
            format!("limit must be a number between 1 and {MAX_PAGE}"),
        ))
    }
}

/// The page after the cursor `after` (from a previous page), refused naming `after` when it
/// is not one.
pub fn after(after: Option<&str>) -> Result<After> {
    after
        .map(|a| {
            parse_cursor(a).ok_or_else(|| {
                AppError::malformed(
                    "after",
                    format!("after {a:?} is not a cursor from a previous page"),
                )
            })
        })
        .transpose()
}

/// One keyset page, newest first.
#[derive(Debug)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// The cursor of the next page when this one is full.
    pub next_cursor: Option<String>,
}

impl<T> Page<T> {
    /// The page `items` make of a page of `limit`, `key` naming each item's place.
    pub fn new(items: Vec<T>, limit: i64, key: impl Fn(&T) -> (DateTime<Utc>, Uuid)) -> Self {
        let next_cursor = (items.len() as i64 == limit)
            .then(|| items.last().map(|last| cursor(key(last))))
            .flatten();
        Self { items, next_cursor }
    }
}

/// The keyset cursor of an item: `created_at/id` (clients treat it as opaque).
pub fn cursor((at, id): (DateTime<Utc>, Uuid)) -> String {
    format!(
        "{}/{}",
        at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        id
    )
}

/// Reads a cursor [`cursor`] made; `None` when `s` is not one (its time outside the years
/// 1970–9999 included: no item was created then).
pub fn parse_cursor(s: &str) -> Option<(DateTime<Utc>, Uuid)> {
    let (at, id) = s.split_once('/')?;
    let at = DateTime::parse_from_rfc3339(at).ok()?.with_timezone(&Utc);
    if !(1970..=9999).contains(&chrono::Datelike::year(&at)) {
        return None;
    }
    Some((at, Uuid::parse_str(id).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip() {
        // The cursor as lists print it, read back: the same instant (to the microsecond) and id.
        let at = Utc::now();
        let id = Uuid::new_v4();
        let (a, i) = parse_cursor(&cursor((at, id))).expect("a cursor it made");
        assert_eq!(i, id);
        assert_eq!(a.timestamp_micros(), at.timestamp_micros());
        let ancient = format!("0000-01-01T00:00:00Z/{id}");
        for bad in ["", "x/y", "2026-01-01T00:00:00Z", &id.to_string(), &ancient] {
            assert!(parse_cursor(bad).is_none(), "{bad}");
            assert!(after(Some(bad)).is_err(), "{bad}");
        }
        for limit in [0, -1, MAX_PAGE + 1, i64::MAX] {
            assert!(check_limit(limit).is_err(), "{limit}");
        }
        assert!(check_limit(1).is_ok() && check_limit(MAX_PAGE).is_ok());
    }
}
