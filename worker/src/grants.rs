//! Rate limit grants: room a worker process reserved in PostgreSQL for several model calls at
//! once (`db::rate_limits::reserve`), handed out to its calls without another round trip until
//! the grant's bucket ends, then settled in one statement: the unused part returned, each
//! call's reported usage in place of its share, the largest under-estimate learned.
//!
//! Far from a limit a grant covers up to [`WANT`] calls, so a limit nobody is near costs about
//! one statement per [`WANT`] calls and one per bucket; near it, the database grants a quarter
//! of what is left at most, down to one call, so every process finds room. A process that dies
//! holding a grant leaves it counted at estimate until it leaves the window.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentq_core::db::{
    self,
    rate_limits::{Held, Reservation, Settlement},
};
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

/// The most calls one grant covers.
const WANT: i32 = 64;
/// Open grants kept before the ended ones are forgotten (one per tenant and set of limits).
const PRUNE_AT: usize = 1024;
/// A grant is not handed out this close to its bucket's end: the call is sent a little later.
const END_MARGIN: Duration = Duration::from_millis(10);

/// What a call's reservation came to.
pub(crate) enum Outcome {
    /// Its share of a grant.
    Held(Share),
    /// No room until `reopens_at`, or sooner if `settling`.
    Refused {
        limit: Uuid,
        reopens_at: DateTime<Utc>,
        settling: bool,
    },
    /// Larger than a whole window of `limit`.
    Never { limit: Uuid, reserved: i64 },
    /// The limits were removed since the process last read them: nothing to reserve.
    Gone,
}

/// One call's share of a grant, until it is settled.
pub(crate) struct Share {
    grant: Arc<Grant>,
    /// Tokens of each limit of the grant, in its order.
    tokens: Vec<i64>,
    estimate: i64,
}

impl Share {
    /// The call's estimate, tokens in and out.
    pub(crate) fn estimate(&self) -> i64 {
        self.estimate
    }
}

struct Grant {
    expires: Instant,
    state: Mutex<State>,
}

struct State {
    limits: Vec<Part>,
    requests_left: i64,
    /// Calls taken and not yet returned.
    in_flight: usize,
    /// A call of the size last taken would not fit again: the grant is settled as soon as its
    /// calls have returned, rather than when its bucket ends.
    spent: bool,
    settled: bool,
}

/// A grant's part in one limit.
struct Part {
    held: Held,
    tokens_left: i64,
    /// Calls' reported usage minus their shares, so far.
    delta: i64,
    /// The largest ratio of a call's usage to its estimate.
    peak: f64,
}

impl State {
    /// Takes one call of `estimate` out of the grant, if it fits.
    fn take(&mut self, estimate: i64) -> Option<Vec<i64>> {
        let tokens: Vec<i64> = self
            .limits
            .iter()
            .map(|p| (estimate as f64 * p.held.ratio).ceil() as i64)
            .collect();
        let fits = |s: &Self| {
            s.requests_left >= 1
                && s.limits
                    .iter()
                    .zip(&tokens)
                    .all(|(p, t)| p.tokens_left >= *t)
        };
        if self.settled || !fits(self) {
            self.spent = true;
            return None;
        }
        self.requests_left -= 1;
        for (p, t) in self.limits.iter_mut().zip(&tokens) {
            p.tokens_left -= t;
        }
        self.in_flight += 1;
        self.spent = !fits(self);
        Some(tokens)
    }

    /// Records a returned call's usage in the grant while it is open, and settles the grant if
    /// it has nothing more to hand out and nothing in flight (its room is back before its
    /// bucket ends); a call returning after its grant was settled is a settlement of its own.
    fn returned(&mut self, share: &Share, used: i64, ratio: f64) -> Option<Vec<Settlement>> {
        self.in_flight -= 1;
        if self.settled {
            return Some(
                self.limits
                    .iter()
                    .zip(&share.tokens)
                    .map(|(p, t)| Settlement {
                        limit: p.held.limit,
                        bucket: p.held.bucket,
                        tokens: used - t,
                        requests: 0,
                        pending: 0,
                        ratio,
                    })
                    .collect(),
            );
        }
        for (p, t) in self.limits.iter_mut().zip(&share.tokens) {
            p.delta += used - t;
            p.peak = p.peak.max(ratio);
        }
        if self.spent && self.in_flight == 0 {
            self.settle()
        } else {
            None
        }
    }

    /// The settlement of what is left, once: the unused part returned, the returned calls'
    /// usage in place of their shares; none if it was settled already.
    fn settle(&mut self) -> Option<Vec<Settlement>> {
        if self.settled {
            return None;
        }
        self.settled = true;
        let requests_left = self.requests_left;
        Some(
            self.limits
                .iter()
                .map(|p| Settlement {
                    limit: p.held.limit,
                    bucket: p.held.bucket,
                    tokens: p.delta - p.tokens_left,
                    requests: -requests_left,
                    pending: -1,
                    ratio: p.peak,
                })
                .collect(),
        )
    }
}

/// Whose calls a grant serves: a tenant's, in a set of limits. A grant is its tenant's alone,
/// so one made in a tenant's turn never serves another's calls, and a tenant never waits
/// behind another's asks.
type GrantKey = (String, Vec<Uuid>);

/// The process's open grants, one per tenant and set of limits.
pub(crate) struct Grants {
    pool: PgPool,
    open: Mutex<HashMap<GrantKey, Arc<Grant>>>,
    /// Per tenant and set of limits: held by the call asking the database for a new grant.
    asking: Mutex<HashMap<GrantKey, Arc<tokio::sync::Mutex<()>>>>,
}

impl Grants {
    pub(crate) fn new(pool: PgPool) -> Self {
        Self {
            pool,
            open: Mutex::new(HashMap::new()),
            asking: Mutex::new(HashMap::new()),
        }
    }

    /// Reserves one call of `tenant`'s of `estimate` tokens in the limits `ids` (sorted): from
    /// the tenant's open grant of those limits if it has room, else by a new grant.
    pub(crate) async fn reserve(
        &self,
        tenant: &str,
        ids: &[Uuid],
        estimate: i64,
    ) -> db::Result<Outcome> {
        let key: GrantKey = (tenant.to_string(), ids.to_vec());
        if let Some(share) = self.take_open(&key, estimate) {
            return Ok(Outcome::Held(share));
        }
        // One call at a time asks for a new grant of these limits; the calls that waited
        // meanwhile take theirs from it.
        let asking = self
            .asking
            .lock()
            .expect("grants lock")
            .entry(key.clone())
            .or_default()
            .clone();
        let _asking = asking.lock().await;
        if let Some(share) = self.take_open(&key, estimate) {
            return Ok(Outcome::Held(share));
        }
        let reserved = db::rate_limits::reserve(&self.pool, tenant, ids, estimate, WANT);
        let grant = match db::within(reserved).await? {
            Reservation::Granted(g) => g,
            Reservation::Refused {
                limit,
                reopens_at,
                settling,
            } => {
                return Ok(Outcome::Refused {
                    limit,
                    reopens_at,
                    settling,
                });
            }
            Reservation::Never { limit, reserved } => {
                return Ok(Outcome::Never { limit, reserved });
            }
        };
        if grant.held.is_empty() {
            return Ok(Outcome::Gone);
        }
        let requests = grant.held.iter().map(|h| h.requests).min().unwrap_or(0);
        let mut state = State {
            limits: grant
                .held
                .iter()
                .map(|h| Part {
                    held: *h,
                    tokens_left: h.tokens,
                    delta: 0,
                    peak: 0.0,
                })
                .collect(),
            requests_left: requests,
            in_flight: 0,
            spent: false,
            settled: false,
        };
        let tokens = state
            .take(estimate)
            .expect("a grant covers the call that asked for it");
        let opened = Arc::new(Grant {
            expires: Instant::now() + grant.expires_in,
            state: Mutex::new(state),
        });
        {
            let mut open = self.open.lock().expect("grants lock");
            if open.len() >= PRUNE_AT {
                let now = Instant::now();
                open.retain(|_, g| g.expires > now);
                self.asking
                    .lock()
                    .expect("grants lock")
                    .retain(|_, a| Arc::strong_count(a) > 1);
            }
            open.insert(key, opened.clone());
        }
        let (pool, settling) = (self.pool.clone(), opened.clone());
        tokio::spawn(async move {
            tokio::time::sleep_until(settling.expires.into()).await;
            settle_grant(&pool, &settling).await;
        });
        Ok(Outcome::Held(Share {
            grant: opened,
            tokens,
            estimate,
        }))
    }

    fn take_open(&self, key: &GrantKey, estimate: i64) -> Option<Share> {
        let open = self.open.lock().expect("grants lock").get(key).cloned();
        let grant = open.filter(|g| Instant::now() + END_MARGIN < g.expires)?;
        let tokens = grant.state.lock().expect("grant lock").take(estimate)?;
        Some(Share {
            grant,
            tokens,
            estimate,
        })
    }

    /// Records what a call used (`used` tokens): into its grant's settlement while the grant
    /// is open, else in a statement of its own.
    pub(crate) async fn settle_call(&self, share: Share, used: i64) {
        let ratio = if share.estimate > 0 {
            used as f64 / share.estimate as f64
        } else {
            0.0
        };
        let settled = share
            .grant
            .state
            .lock()
            .expect("grant lock")
            .returned(&share, used, ratio);
        if let Some(settled) = settled {
            write(&self.pool, &settled).await;
        }
    }
}

/// Settles a grant whose bucket ended (unless it was settled already): returns what its calls
/// did not take, applies what the returned ones used, and stops handing it out. Calls still in
/// flight settle on their own.
async fn settle_grant(pool: &PgPool, grant: &Grant) {
    let settled = grant.state.lock().expect("grant lock").settle();
    if let Some(settled) = settled {
        write(pool, &settled).await;
    }
}

async fn write(pool: &PgPool, settled: &[Settlement]) {
    if let Err(e) = db::within(db::rate_limits::settle(pool, settled)).await {
        tracing::warn!(error = %e, "settling a rate limit grant failed; it stays counted until it leaves the window");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(tokens: i64, ratio: f64) -> Part {
        Part {
            held: Held {
                limit: Uuid::nil(),
                bucket: 0,
                tokens,
                requests: 0,
                ratio,
            },
            tokens_left: tokens,
            delta: 0,
            peak: 0.0,
        }
    }

    #[test]
    fn a_grant_hands_out_calls_while_every_limit_and_the_requests_have_room() {
        let mut state = State {
            limits: vec![part(3_000, 1.0), part(3_002, 1.5)],
            requests_left: 5,
            in_flight: 0,
            spent: false,
            settled: false,
        };
        // 1,000 tokens: 1,000 of the first limit, 1,500 of the second (its learned ratio).
        assert_eq!(state.take(1_000), Some(vec![1_000, 1_500]));
        assert_eq!(state.take(1_000), Some(vec![1_000, 1_500]));
        assert_eq!(state.take(1_000), None, "the second limit has no room left");
        assert_eq!(state.requests_left, 3, "a refused take takes nothing");
        assert_eq!(state.take(1), Some(vec![1, 2]), "rounded up, never down");
        state.requests_left = 0;
        assert_eq!(state.take(1), None, "no call left");
        state.requests_left = 1;
        state.settled = true;
        assert_eq!(state.take(1), None, "a settled grant hands out nothing");
    }
}
