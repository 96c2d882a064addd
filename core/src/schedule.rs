//! Schedules' ticks, pure: when a cron expression in an IANA time zone or a fixed interval
//! fires ([`Spec`]), and what a scheduler does with the ticks that are due ([`plan`]): fire,
//! skip for overlap, buffer one, or count as missed past the catch-up window. No I/O: the SQL
//! that applies a plan is `db::schedules::fire_due`.
//!
//! Ticks are whole seconds in UTC, between the years 1970 and 9999. A cron expression takes an
//! optional seconds field first and an optional year field last (the `croner` crate); its
//! wall-clock times are read in the schedule's zone with the zone's daylight-saving rules: a
//! time the clock skips (spring forward) fires at the first instant after the gap, a time the
//! clock repeats (fall back) fires once, at its first occurrence. An interval's ticks are the
//! multiples of it since the Unix epoch (every 60 s fires at :00), so they need no anchor.

use std::str::FromStr;

use chrono::{DateTime, Datelike, TimeZone, Utc};
use croner::Cron;

use crate::state::Overlap;

/// Shortest interval.
pub const MIN_INTERVAL_SECS: i64 = 1;
/// Longest interval: a year (a longer one is a cron expression's job, or a typo).
pub const MAX_INTERVAL_SECS: i64 = 366 * 86_400;
/// Longest cron expression accepted.
pub const MAX_CRON_LEN: usize = 256;
/// Shortest catch-up window.
pub const MIN_CATCHUP_SECS: i64 = 1;
/// Longest catch-up window: a year.
pub const MAX_CATCHUP_SECS: i64 = 366 * 86_400;
/// The catch-up window when none is given: ticks missed during an hour's downtime still fire.
pub const DEFAULT_CATCHUP_SECS: i64 = 3_600;

/// When a schedule fires.
#[derive(Clone, Debug)]
pub enum Spec {
    /// A cron expression read in an IANA time zone.
    Cron {
        expr: String,
        cron: Box<Cron>,
        zone: chrono_tz::Tz,
    },
    /// Every `secs` seconds, at the multiples of it since the Unix epoch.
    Interval { secs: i64 },
}

impl Spec {
    /// A cron expression in `zone` (an IANA name such as `Europe/Berlin`, or `UTC`). Refused:
    /// an expression croner cannot read, an unknown zone, an expression with no tick ahead of
    /// `now`.
    pub fn cron(expr: &str, zone: &str, now: DateTime<Utc>) -> Result<Self, String> {
        let expr = expr.trim();
        if expr.is_empty() || expr.len() > MAX_CRON_LEN {
            return Err(format!(
                "a cron expression is 1-{MAX_CRON_LEN} characters, such as \"0 9 * * MON-FRI\" \
                 (minute hour day-of-month month day-of-week, an optional seconds field first)"
            ));
        }
        let zone = chrono_tz::Tz::from_str(zone.trim()).map_err(|_| {
            format!(
                "unknown time zone {zone:?}: use an IANA name such as UTC, Europe/Berlin or \
                 America/New_York"
            )
        })?;
        let cron = Cron::from_str(expr).map_err(|e| {
            format!(
                "cron expression {expr:?} is not valid ({e}); use five fields (minute hour \
                 day-of-month month day-of-week) or six with seconds first, e.g. \"*/15 * * * *\""
            )
        })?;
        let spec = Spec::Cron {
            expr: expr.to_string(),
            cron: Box::new(cron),
            zone,
        };
        if spec.next_after(now).is_none() {
            return Err(format!(
                "cron expression {expr:?} has no tick after {} before the year 10000: it would \
                 never fire",
                now.format("%Y-%m-%d %H:%M:%S UTC")
            ));
        }
        Ok(spec)
    }

    /// Every `secs` seconds, 1 s to a year.
    pub fn interval(secs: i64) -> Result<Self, String> {
        if !(MIN_INTERVAL_SECS..=MAX_INTERVAL_SECS).contains(&secs) {
            return Err(format!(
                "an interval is {MIN_INTERVAL_SECS} s to {MAX_INTERVAL_SECS} s (a year); got \
                 {secs} s"
            ));
        }
        Ok(Spec::Interval { secs })
    }

    /// The spec a stored schedule row names (checked when it was added).
    pub fn stored(
        cron: Option<&str>,
        zone: Option<&str>,
        interval_secs: Option<i64>,
    ) -> Result<Self, String> {
        match (cron, zone, interval_secs) {
            (Some(expr), Some(zone), None) => {
                let zone = chrono_tz::Tz::from_str(zone)
                    .map_err(|_| format!("stored time zone {zone:?} is unknown"))?;
                let cron = Cron::from_str(expr)
                    .map_err(|e| format!("stored cron expression {expr:?}: {e}"))?;
                Ok(Spec::Cron {
                    expr: expr.to_string(),
                    cron: Box::new(cron),
                    zone,
                })
            }
            (None, None, Some(secs)) => Spec::interval(secs),
            _ => Err("a schedule has either a cron expression and a zone, or an interval".into()),
        }
    }

    /// The shortest time between two of its ticks: the interval, or for a cron expression the
    /// closest two of its next 64 ticks after `now` (enough to meet any second- or minute-level
    /// pattern a limit is for).
    pub fn shortest_gap(&self, now: DateTime<Utc>) -> std::time::Duration {
        let secs = match self {
            Spec::Interval { secs } => *secs,
            Spec::Cron { .. } => {
                let mut shortest = i64::MAX;
                let mut t = now;
                let mut previous: Option<DateTime<Utc>> = None;
                for _ in 0..64 {
                    let Some(next) = self.next_after(t) else {
                        break;
                    };
                    if let Some(p) = previous {
                        shortest = shortest.min((next - p).num_seconds());
                    }
                    previous = Some(next);
                    t = next;
                }
                shortest
            }
        };
        std::time::Duration::from_secs(secs.max(0) as u64)
    }

    /// The first tick strictly after `t`, or `None` when there is none before the year 10000.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let next = match self {
            Spec::Interval { secs } => {
                // `timestamp()` floors, so a fractional `t` past a tick gives the next one.
                let k = t.timestamp().div_euclid(*secs).checked_add(1)?;
                Utc.timestamp_opt(k.checked_mul(*secs)?, 0).single()?
            }
            Spec::Cron { cron, zone, .. } => {
                let from = Utc
                    .timestamp_opt(t.timestamp(), 0)
                    .single()?
                    .with_timezone(zone);
                cron.find_next_occurrence(&from, false)
                    .ok()?
                    .with_timezone(&Utc)
            }
        };
        (next > t && next.year() <= 9999).then_some(next)
    }

    /// Up to `n` ticks from `from` on, `from` itself included when it is one.
    pub fn upcoming(&self, from: DateTime<Utc>, n: usize) -> Vec<DateTime<Utc>> {
        let mut out = Vec::with_capacity(n);
        let mut at = from.checked_sub_signed(chrono::Duration::seconds(1));
        while out.len() < n {
            match at.and_then(|t| self.next_after(t)) {
                Some(t) => {
                    if t >= from {
                        out.push(t);
                    }
                    at = Some(t);
                }
                None => break,
            }
        }
        out
    }

    /// The cron expression, if it is one.
    pub fn cron_expr(&self) -> Option<&str> {
        match self {
            Spec::Cron { expr, .. } => Some(expr),
            Spec::Interval { .. } => None,
        }
    }

    /// The time zone's IANA name, for a cron expression.
    pub fn zone_name(&self) -> Option<&'static str> {
        match self {
            Spec::Cron { zone, .. } => Some(zone.name()),
            Spec::Interval { .. } => None,
        }
    }

    /// The interval in seconds, if it is one.
    pub fn interval_secs(&self) -> Option<i64> {
        match self {
            Spec::Interval { secs } => Some(*secs),
            Spec::Cron { .. } => None,
        }
    }
}

/// Checks a catch-up window.
pub fn check_catchup(secs: i64) -> Result<i64, String> {
    if (MIN_CATCHUP_SECS..=MAX_CATCHUP_SECS).contains(&secs) {
        Ok(secs)
    } else {
        Err(format!(
            "a catch-up window is {MIN_CATCHUP_SECS} s to {MAX_CATCHUP_SECS} s (a year); got \
             {secs} s"
        ))
    }
}

/// The dedupe key of the operation a schedule fires for `tick`: the same for every scheduler,
/// so a tick is one operation however many fire it.
pub fn firing_key(schedule: uuid::Uuid, tick: DateTime<Utc>) -> String {
    format!(
        "schedule:{schedule}:{}",
        tick.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    )
}

/// Where a schedule stands when a scheduler looks at it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct State {
    /// The next tick not handled yet.
    pub next_tick: Option<DateTime<Utc>>,
    /// A tick kept by `buffer_one` until the previous firing ends.
    pub buffered: Option<DateTime<Utc>>,
    /// Whether the operation of the latest firing is unfinished.
    pub previous_running: bool,
}

/// What to do with a schedule now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Ticks to fire, in order (a buffered one first).
    pub fire: Vec<DateTime<Utc>>,
    pub next_tick: Option<DateTime<Utc>>,
    pub buffered: Option<DateTime<Utc>>,
    /// Ticks not fired because the previous firing was unfinished.
    pub skipped_overlap: i64,
    /// Ticks older than the catch-up window.
    pub missed: i64,
}

impl Plan {
    /// True when the plan changes nothing.
    pub fn is_idle(&self, state: &State) -> bool {
        self.fire.is_empty()
            && self.next_tick == state.next_tick
            && self.buffered == state.buffered
            && self.skipped_overlap == 0
            && self.missed == 0
    }
}

/// Ticks one pass looks at per schedule at most (fired, skipped or missed); a schedule with
/// more due is continued by the next pass.
pub const TICKS_PER_PASS: usize = 10_000;

/// What a scheduler does at `now` with a schedule in `state`: a buffered tick fires once the
/// previous firing ended; each due tick (at most `max_fire` fired, [`TICKS_PER_PASS`] looked
/// at) is missed when older than `catchup_secs`, else fired or not as `overlap` says, a tick
/// fired now counting as unfinished for the ticks after it.
pub fn plan(
    spec: &Spec,
    overlap: Overlap,
    catchup_secs: i64,
    state: State,
    now: DateTime<Utc>,
    max_fire: usize,
) -> Plan {
    let mut p = Plan {
        next_tick: state.next_tick,
        buffered: state.buffered,
        ..Plan::default()
    };
    let mut running = state.previous_running;
    if let Some(b) = p.buffered
        && !running
    {
        p.fire.push(b);
        p.buffered = None;
        running = true;
    }
    let oldest = now - chrono::Duration::seconds(catchup_secs);
    let mut looked = 0;
    while let Some(t) = p.next_tick
        && t <= now
        && p.fire.len() < max_fire
        && looked < TICKS_PER_PASS
    {
        looked += 1;
        p.next_tick = spec.next_after(t);
        if t < oldest {
            p.missed += 1;
            continue;
        }
        match overlap {
            _ if !running => {
                p.fire.push(t);
                running = true;
            }
            Overlap::Allow => p.fire.push(t),
            Overlap::BufferOne if p.buffered.is_none() => p.buffered = Some(t),
            Overlap::Skip | Overlap::BufferOne => p.skipped_overlap += 1,
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn now() -> DateTime<Utc> {
        at("2026-06-01T12:00:00.250Z")
    }

    fn cron(expr: &str, zone: &str) -> Spec {
        Spec::cron(expr, zone, now()).unwrap()
    }

    fn ticks(spec: &Spec, from: &str, n: usize) -> Vec<String> {
        spec.upcoming(at(from), n)
            .iter()
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            .collect()
    }

    #[test]
    fn the_shortest_gap_is_the_interval_or_the_closest_cron_ticks() {
        let secs = |s: &Spec| s.shortest_gap(now()).as_secs();
        assert_eq!(secs(&Spec::interval(90).unwrap()), 90);
        assert_eq!(secs(&cron("*/5 * * * * *", "UTC")), 5);
        assert_eq!(secs(&cron("0,1 * * * *", "UTC")), 60);
        assert_eq!(secs(&cron("30 2 * * *", "Europe/Berlin")), 86_400);
    }

    #[test]
    fn intervals_tick_at_multiples_since_the_epoch() {
        let every = Spec::interval(60).unwrap();
        assert_eq!(
            every.next_after(now()),
            Some(at("2026-06-01T12:01:00Z")),
            "a fractional time goes to the next multiple"
        );
        assert_eq!(
            every.next_after(at("2026-06-01T12:01:00Z")),
            Some(at("2026-06-01T12:02:00Z")),
            "strictly after"
        );
        assert_eq!(
            ticks(&Spec::interval(1).unwrap(), "2026-06-01T12:00:00Z", 3),
            [
                "2026-06-01T12:00:00Z",
                "2026-06-01T12:00:01Z",
                "2026-06-01T12:00:02Z"
            ],
            "upcoming includes its start when it is a tick"
        );
        for bad in [0, -5, MAX_INTERVAL_SECS + 1, i64::MAX] {
            let e = Spec::interval(bad).unwrap_err();
            assert!(e.contains("an interval is 1 s to"), "{bad}: {e}");
        }
    }

    #[test]
    fn cron_expressions_read_in_their_zone_with_optional_seconds() {
        // 09:00 in Berlin in June (CEST, UTC+2) is 07:00 UTC.
        let spec = cron("0 9 * * *", "Europe/Berlin");
        assert_eq!(spec.next_after(now()), Some(at("2026-06-02T07:00:00Z")));
        assert_eq!(
            ticks(&cron("*/20 * * * * *", "UTC"), "2026-06-01T12:00:05Z", 3),
            [
                "2026-06-01T12:00:20Z",
                "2026-06-01T12:00:40Z",
                "2026-06-01T12:01:00Z"
            ]
        );
        assert_eq!(spec.zone_name(), Some("Europe/Berlin"));
        assert_eq!(spec.cron_expr(), Some("0 9 * * *"));
    }

    #[test]
    fn a_time_the_clock_skips_fires_after_the_gap_and_a_repeated_one_fires_once() {
        // Europe/Berlin springs forward on 2026-03-29: 02:00 CET becomes 03:00 CEST, so 02:30
        // does not exist that day.
        let spec = cron("30 2 * * *", "Europe/Berlin");
        assert_eq!(
            ticks(&spec, "2026-03-28T00:00:00Z", 3),
            [
                "2026-03-28T01:30:00Z", // 02:30 CET
                "2026-03-29T01:00:00Z", // 03:00 CEST: the first instant after the gap
                "2026-03-30T00:30:00Z", // 02:30 CEST
            ]
        );
        // Every hour across the gap: the skipped hour does not fire twice.
        let hourly = cron("0 * * * *", "Europe/Berlin");
        assert_eq!(
            ticks(&hourly, "2026-03-29T00:00:00Z", 3),
            [
                "2026-03-29T00:00:00Z", // 01:00 CET
                "2026-03-29T01:00:00Z", // 03:00 CEST (02:00 CET never happens)
                "2026-03-29T02:00:00Z", // 04:00 CEST
            ]
        );
        // It falls back on 2026-10-25: 03:00 CEST becomes 02:00 CET, so 02:30 happens twice;
        // it fires once, at the first.
        assert_eq!(
            ticks(&spec, "2026-10-24T12:00:00Z", 3),
            [
                "2026-10-25T00:30:00Z", // 02:30 CEST, the first 02:30
                "2026-10-26T01:30:00Z", // 02:30 CET the next day
                "2026-10-27T01:30:00Z",
            ]
        );
        // New York: 2026-03-08 springs forward at 02:00 EST → 03:00 EDT.
        let ny = cron("15 2 * * *", "America/New_York");
        assert_eq!(
            ticks(&ny, "2026-03-07T12:00:00Z", 2),
            ["2026-03-08T07:00:00Z", "2026-03-09T06:15:00Z"]
        );
    }

    #[test]
    fn far_future_ticks_stop_before_the_year_10000() {
        // Once a year, in the last year croner searches: found; after it, nothing.
        let yearly = cron("0 0 0 1 1 * 4999", "UTC");
        assert_eq!(yearly.next_after(now()), Some(at("4999-01-01T00:00:00Z")));
        assert_eq!(yearly.next_after(at("4999-01-01T00:00:00Z")), None);
        // An interval near the end of the range.
        let year = Spec::interval(MAX_INTERVAL_SECS).unwrap();
        assert_eq!(year.next_after(at("9999-12-31T00:00:00Z")), None);
        assert!(year.next_after(at("9998-01-01T00:00:00Z")).is_some());
        assert!(year.upcoming(at("9998-01-01T00:00:00Z"), 10).len() <= 2);
        // An expression with no tick ahead is refused when added.
        let e = Spec::cron("0 0 0 1 1 * 2020", "UTC", now()).unwrap_err();
        assert!(e.contains("would never fire"), "{e}");
        let e = Spec::cron("0 0 30 2 *", "UTC", now()).unwrap_err();
        assert!(
            e.contains("would never fire") || e.contains("not valid"),
            "{e}"
        );
    }

    #[test]
    fn bad_expressions_and_zones_are_refused_by_name() {
        for (expr, zone, says) in [
            ("every minute", "UTC", "is not valid"),
            ("61 * * * *", "UTC", "is not valid"),
            ("* * *", "UTC", "is not valid"),
            ("", "UTC", "1-256 characters"),
            ("* * * * *", "Mars/Olympus_Mons", "unknown time zone"),
            ("* * * * *", "", "unknown time zone"),
        ] {
            let e = Spec::cron(expr, zone, now()).unwrap_err();
            assert!(e.contains(says), "{expr:?} {zone:?}: {e}");
        }
        assert!(Spec::cron(&"*".repeat(300), "UTC", now()).is_err());
    }

    #[test]
    fn stored_specs_read_back() {
        let s = Spec::stored(Some("0 9 * * *"), Some("Asia/Tokyo"), None).unwrap();
        assert_eq!(s.zone_name(), Some("Asia/Tokyo"));
        assert_eq!(
            Spec::stored(None, None, Some(30)).unwrap().interval_secs(),
            Some(30)
        );
        assert!(Spec::stored(Some("* * * * *"), None, Some(3)).is_err());
    }

    #[test]
    fn firing_keys_name_the_schedule_and_the_tick() {
        let id = uuid::Uuid::nil();
        assert_eq!(
            firing_key(id, at("2026-06-01T14:00:00+02:00")),
            "schedule:00000000-0000-0000-0000-000000000000:2026-06-01T12:00:00Z"
        );
    }

    fn state(next: &str, buffered: Option<&str>, running: bool) -> State {
        State {
            next_tick: Some(at(next)),
            buffered: buffered.map(at),
            previous_running: running,
        }
    }

    #[test]
    fn plans_fire_due_ticks_by_the_overlap_policy() {
        let every = Spec::interval(1).unwrap();
        let now = at("2026-06-01T12:00:04.5Z");
        // Five ticks due (:00 … :04), the previous firing finished.
        let s = state("2026-06-01T12:00:00Z", None, false);
        let allow = plan(&every, Overlap::Allow, 60, s, now, 100);
        assert_eq!(allow.fire.len(), 5);
        assert_eq!(allow.next_tick, Some(at("2026-06-01T12:00:05Z")));
        assert_eq!((allow.skipped_overlap, allow.missed), (0, 0));

        let skip = plan(&every, Overlap::Skip, 60, s, now, 100);
        assert_eq!(skip.fire, [at("2026-06-01T12:00:00Z")]);
        assert_eq!(skip.skipped_overlap, 4);

        let one = plan(&every, Overlap::BufferOne, 60, s, now, 100);
        assert_eq!(one.fire, [at("2026-06-01T12:00:00Z")]);
        assert_eq!(one.buffered, Some(at("2026-06-01T12:00:01Z")));
        assert_eq!(one.skipped_overlap, 3);

        // The previous firing still runs: skip fires nothing, buffer_one keeps one.
        let s = state("2026-06-01T12:00:04Z", None, true);
        assert!(plan(&every, Overlap::Skip, 60, s, now, 100).fire.is_empty());
        let one = plan(&every, Overlap::BufferOne, 60, s, now, 100);
        assert_eq!(
            (one.fire.len(), one.buffered),
            (0, Some(at("2026-06-01T12:00:04Z")))
        );
        assert_eq!(plan(&every, Overlap::Allow, 60, s, now, 100).fire.len(), 1);

        // A buffered tick fires once the previous firing ended, before the due ones.
        let s = state("2026-06-01T12:00:04Z", Some("2026-06-01T12:00:02Z"), false);
        let one = plan(&every, Overlap::BufferOne, 60, s, now, 100);
        assert_eq!(one.fire, [at("2026-06-01T12:00:02Z")]);
        assert_eq!(one.buffered, Some(at("2026-06-01T12:00:04Z")));
        // …and waits while it still runs.
        let s = State {
            previous_running: true,
            next_tick: Some(at("2026-06-01T12:00:05Z")),
            ..s
        };
        assert!(plan(&every, Overlap::BufferOne, 60, s, now, 100).is_idle(&s));
    }

    #[test]
    fn ticks_older_than_the_catch_up_window_are_missed_and_counted() {
        let every = Spec::interval(1).unwrap();
        // Down from :00 to :20; a window of 5 s fires :15 … :20 and counts :00 … :14.
        let now = at("2026-06-01T12:00:20Z");
        let s = state("2026-06-01T12:00:00Z", None, false);
        let p = plan(&every, Overlap::Allow, 5, s, now, 100);
        assert_eq!(p.missed, 15);
        assert_eq!(p.fire.first(), Some(&at("2026-06-01T12:00:15Z")));
        assert_eq!(p.fire.len(), 6);
        assert_eq!(p.next_tick, Some(at("2026-06-01T12:00:21Z")));
        // At most `max_fire` fire per pass; the rest wait for the next.
        let p = plan(&every, Overlap::Allow, 60, s, now, 4);
        assert_eq!(p.fire.len(), 4);
        assert_eq!(p.next_tick, Some(at("2026-06-01T12:00:04Z")));
        // Nothing due: nothing changes.
        let s = state("2026-06-01T12:00:21Z", None, false);
        assert!(plan(&every, Overlap::Skip, 5, s, now, 100).is_idle(&s));
        // A schedule with no tick left does nothing.
        let done = State {
            next_tick: None,
            buffered: None,
            previous_running: false,
        };
        assert!(plan(&every, Overlap::Allow, 5, done, now, 100).is_idle(&done));
    }
}
