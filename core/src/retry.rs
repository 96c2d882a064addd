//! The job-level retry schedule: when a failed attempt may run again. Retries are data
//! (`run_at`), never an in-memory loop holding a worker.

use std::time::Duration;

use chrono::{DateTime, Utc};

/// First retry delay.
pub const BASE_DELAY: Duration = Duration::from_secs(1);
/// Longest delay between attempts.
pub const MAX_DELAY: Duration = Duration::from_secs(600);

/// Delay before attempt `attempt + 1`: exponential from [`BASE_DELAY`], capped at
/// [`MAX_DELAY`], with up to 25 % random jitter so a burst of failures does not retry in lockstep.
pub fn delay(attempt: i32) -> Duration {
    let exp = attempt.clamp(1, 30) - 1;
    let base = BASE_DELAY
        .saturating_mul(1u32 << exp.min(20))
        .min(MAX_DELAY);
    let jitter = base.mul_f64(0.25 * (uuid::Uuid::new_v4().as_u128() % 1000) as f64 / 1000.0);
    base + jitter
}

/// When attempt `attempt + 1` may start: after the backoff, and not before `not_before`.
pub fn next_run_at(attempt: i32, not_before: Option<DateTime<Utc>>) -> DateTime<Utc> {
    let after = Utc::now() + chrono::Duration::from_std(delay(attempt)).unwrap_or_default();
    not_before.map_or(after, |nb| nb.max(after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_and_cap() {
        assert!(delay(1) >= BASE_DELAY && delay(1) <= BASE_DELAY.mul_f64(1.25));
        assert!(delay(3) >= Duration::from_secs(4));
        assert!(delay(50) <= MAX_DELAY.mul_f64(1.25));
    }

    #[test]
    fn not_before_wins_when_later() {
        let later = Utc::now() + chrono::Duration::hours(1);
        assert_eq!(next_run_at(1, Some(later)), later);
    }
}
