//! The job-level retry schedule: when a failed attempt may run again. Retries are data
//! (`run_at`), never an in-memory loop holding a worker.
//!
//! The delays come from the `backoff` crate named in the design card, kept behind this one
//! module so it can be swapped: `backoff` is unmaintained (RUSTSEC-2025-0012; acknowledged in
//! `deny.toml` and `.cargo/audit.toml`), and `backon` is the advised successor.

use std::time::Duration;

use backoff::backoff::Backoff;
use chrono::{DateTime, Utc};

/// First retry delay.
pub const BASE_DELAY: Duration = Duration::from_secs(1);
/// Longest delay between attempts.
pub const MAX_DELAY: Duration = Duration::from_secs(600);
/// Random spread around each delay (±25 %), so a burst of failures does not retry in lockstep.
pub const JITTER: f64 = 0.25;
/// How much harder an overloaded provider is backed off than an ordinary failure.
pub const OVERLOAD_FACTOR: u32 = 5;

/// Delay before attempt `attempt + 1` after ordinary failure number `attempt` (1-based):
/// exponential from [`BASE_DELAY`] (doubling), capped at [`MAX_DELAY`], with [`JITTER`].
pub fn delay(attempt: i32) -> Duration {
    let mut schedule = backoff::ExponentialBackoff {
        current_interval: BASE_DELAY,
        initial_interval: BASE_DELAY,
        randomization_factor: JITTER,
        multiplier: 2.0,
        max_interval: MAX_DELAY,
        max_elapsed_time: None,
        ..backoff::ExponentialBackoff::default()
    };
    let mut d = BASE_DELAY;
    for _ in 0..attempt.clamp(1, 64) {
        d = schedule.next_backoff().unwrap_or(MAX_DELAY);
    }
    d.min(MAX_DELAY.mul_f64(1.0 + JITTER))
}

/// When the next attempt may start: after the backoff, and not before `not_before`.
pub fn next_run_at(attempt: i32, not_before: Option<DateTime<Utc>>) -> DateTime<Utc> {
    at(delay(attempt), not_before)
}

/// When an operation parked by an overloaded provider may try again (backed off harder).
pub fn overloaded_run_at(attempt: i32, not_before: Option<DateTime<Utc>>) -> DateTime<Utc> {
    at(
        (delay(attempt) * OVERLOAD_FACTOR).min(MAX_DELAY),
        not_before,
    )
}

/// What an operation parked by its worker's open model circuit breaker records as its error
/// (class `overloaded`): the provider and when the breaker may close. The one codec of it: the
/// worker's gate writes it, `agentq why` reads it back ([`breaker_parked_until`]).
pub fn breaker_parked(provider: &str, until: DateTime<Utc>) -> String {
    format!(
        "{BREAKER_PARKED}{provider}{OPEN_UNTIL}{} after repeated failures",
        until.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    )
}

const BREAKER_PARKED: &str = "parked: the circuit for model provider ";
const OPEN_UNTIL: &str = " is open until ";

/// The provider and the time [`breaker_parked`] wrote into `message`, if it is such a message
/// (anywhere in it: a step may have wrapped it).
pub fn breaker_parked_until(message: &str) -> Option<(String, DateTime<Utc>)> {
    let rest = &message[message.find(BREAKER_PARKED)? + BREAKER_PARKED.len()..];
    let (provider, rest) = rest.split_once(OPEN_UNTIL)?;
    let until = rest.split_whitespace().next()?;
    let until = DateTime::parse_from_rfc3339(until).ok()?;
    Some((provider.to_string(), until.with_timezone(&Utc)))
}

/// What an operation parked because its remote kind's service could not be reached records as
/// its error (class `overloaded`): the service and what happened. The one codec of it: the
/// worker writes it, `agentq why` reads it back ([`service_parked_of`]).
pub fn service_parked(service: &str, what: &str) -> String {
    format!("{SERVICE_PARKED}{service:?}{UNAVAILABLE}{what}")
}

const SERVICE_PARKED: &str = "parked: remote service ";
const UNAVAILABLE: &str = " is unavailable: ";

/// The service and what happened, as [`service_parked`] wrote them into `message`, if it is
/// such a message (anywhere in it: a step may have wrapped it).
pub fn service_parked_of(message: &str) -> Option<(String, String)> {
    let rest = &message[message.find(SERVICE_PARKED)? + SERVICE_PARKED.len()..];
    let (quoted, what) = rest.split_once(UNAVAILABLE)?;
    let service = quoted.strip_prefix('"')?.strip_suffix('"')?;
    Some((service.to_string(), what.to_string()))
}

fn at(delay: Duration, not_before: Option<DateTime<Utc>>) -> DateTime<Utc> {
    let after = Utc::now() + chrono::Duration::from_std(delay).unwrap_or_default();
    not_before.map_or(after, |nb| nb.max(after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_breaker_park_reads_back_its_provider_and_time() {
        let until = DateTime::parse_from_rfc3339("2026-12-03T08:15:30Z")
            .unwrap()
            .with_timezone(&Utc);
        let m = breaker_parked("openai", until);
        assert_eq!(breaker_parked_until(&m), Some(("openai".into(), until)));
        let wrapped = format!("step 3 (model) failed: {m}");
        assert_eq!(
            breaker_parked_until(&wrapped),
            Some(("openai".into(), until))
        );
        assert_eq!(breaker_parked_until("model provider overloaded: 529"), None);
    }

    #[test]
    fn a_service_park_reads_back_its_service_and_what_happened() {
        let m = service_parked(
            "billing",
            "connecting to http://127.0.0.1:9 failed: refused",
        );
        let want = Some((
            "billing".to_string(),
            "connecting to http://127.0.0.1:9 failed: refused".to_string(),
        ));
        assert_eq!(service_parked_of(&m), want);
        assert_eq!(service_parked_of(&format!("step s1: {m}")), want);
        assert_eq!(
            service_parked_of("remote service \"billing\": answered HTTP 500"),
            None
        );
    }

    #[test]
    fn delays_grow_exponentially_with_bounded_jitter_and_cap() {
        for _ in 0..50 {
            let d1 = delay(1);
            assert!(
                d1 >= BASE_DELAY.mul_f64(0.75) && d1 <= BASE_DELAY.mul_f64(1.25),
                "{d1:?}"
            );
            let d4 = delay(4);
            assert!(
                d4 >= Duration::from_secs(6) && d4 <= Duration::from_secs(10),
                "{d4:?}"
            );
            assert!(delay(40) <= MAX_DELAY.mul_f64(1.25));
        }
    }

    #[test]
    fn not_before_wins_when_later() {
        let later = Utc::now() + chrono::Duration::hours(1);
        assert_eq!(next_run_at(1, Some(later)), later);
        assert!(next_run_at(1, Some(Utc::now() - chrono::Duration::hours(1))) > Utc::now());
    }

    #[test]
    fn overload_backs_off_harder() {
        let plain = Utc::now() + chrono::Duration::seconds(2);
        assert!(overloaded_run_at(1, None) > plain);
    }
}
