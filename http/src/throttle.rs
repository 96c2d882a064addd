//! Each token's request rate (`AGENTQ_API_TOKEN_RATE`): a token bucket per API token, in this
//! process, that every route behind a token draws on before its handler runs
//! ([`crate::routes::enforce`]). A request costs one unit, and a list page one more per 20 rows
//! it may return (`?limit=1000`: 51), so a token reading large pages in a loop is held to a few
//! of them a second while its enqueues are not. Past its rate a request is answered 429 with
//! `Retry-After` and nothing runs; the bucket holds two seconds of the rate, so a burst that
//! short passes.
//!
//! Every `agentq serve` keeps its own buckets: behind a load balancer over N servers, a token
//! gets up to N times the rate.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::Uri;

/// Rows of a page that cost one unit more.
const ROWS_PER_UNIT: u64 = 20;
/// Seconds of the rate a bucket holds.
const BURST_SECS: f64 = 2.0;
/// Buckets kept before idle full ones are dropped.
const PRUNE_AT: usize = 10_000;

struct Bucket {
    units: f64,
    at: Instant,
}

/// The buckets of every token this process served.
pub(crate) struct Throttle {
    /// Units per second per token; 0: no limit.
    rate: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl Throttle {
    /// `rate` units per second per token (0: none).
    pub(crate) fn new(rate: u32) -> Self {
        Self {
            rate: f64::from(rate),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Units per second per token (0: none).
    pub(crate) fn rate(&self) -> u32 {
        self.rate as u32
    }

    /// Takes `cost` units of `token`'s bucket; when it lacks them, takes nothing and says how
    /// long until it has them.
    pub(crate) fn take(&self, token: &str, cost: u64) -> Result<(), Duration> {
        self.take_at(token, cost, Instant::now())
    }

    fn take_at(&self, token: &str, cost: u64, now: Instant) -> Result<(), Duration> {
        if self.rate <= 0.0 {
            return Ok(());
        }
        let burst = self.rate * BURST_SECS;
        // A request dearer than a whole bucket is let through once the bucket is full.
        let cost = (cost as f64).min(burst);
        let mut buckets = self.buckets.lock().expect("throttle lock");
        if buckets.len() >= PRUNE_AT {
            let rate = self.rate;
            buckets.retain(|_, b| b.units + now.duration_since(b.at).as_secs_f64() * rate < burst);
        }
        let b = buckets.entry(token.to_string()).or_insert(Bucket {
            units: burst,
            at: now,
        });
        b.units = (b.units + now.duration_since(b.at).as_secs_f64() * self.rate).min(burst);
        b.at = now;
        if b.units >= cost {
            b.units -= cost;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((cost - b.units) / self.rate))
        }
    }
}

/// What a request costs: one unit, and one more per [`ROWS_PER_UNIT`] rows its `limit` asks
/// for (a page of a list).
pub(crate) fn cost(uri: &Uri) -> u64 {
    let limit = uri
        .query()
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|pair| pair.strip_prefix("limit="))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    1 + limit.min(1_000) / ROWS_PER_UNIT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_gets_its_burst_then_its_rate_and_others_are_untouched() {
        let t = Throttle::new(10);
        let start = Instant::now();
        for _ in 0..20 {
            t.take_at("a", 1, start).unwrap();
        }
        let wait = t.take_at("a", 1, start).unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_millis(100),
            "{wait:?}"
        );
        // Another token has its own bucket.
        t.take_at("b", 1, start).unwrap();
        // A tenth of a second later, one more unit.
        let later = start + Duration::from_millis(100);
        t.take_at("a", 1, later).unwrap();
        assert!(t.take_at("a", 1, later).is_err());
        // A refusal takes nothing.
        let much_later = start + Duration::from_secs(10);
        t.take_at("a", 20, much_later).unwrap();
    }

    #[test]
    fn no_rate_means_no_limit() {
        let t = Throttle::new(0);
        for _ in 0..10_000 {
            t.take("a", 100).unwrap();
        }
    }

    #[test]
    fn a_page_costs_by_the_rows_it_asks_for() {
        let cost = |u: &str| cost(&u.parse::<Uri>().unwrap());
        assert_eq!(cost("/v1/operations"), 1);
        assert_eq!(cost("/v1/operations?limit=100"), 6);
        assert_eq!(cost("/v1/operations?kind=x&limit=1000"), 51);
        assert_eq!(cost("/v1/operations?limit=99999"), 51);
        assert_eq!(cost("/v1/operations?limit=nope"), 1);
    }
}
