//! How many model calls a worker has in flight, and whose call goes next.
//!
//! The limit is a number the deployment sets (`AGENTQ_MODEL_CONCURRENCY=N`), or, by default
//! (`auto`), found: it starts at [`AUTO_START`] and, until the provider first pushes back,
//! doubles every [`PROBE`] while the gate stays full with calls waiting, and grows by two calls
//! per call that returns while it is full (about three times as many every round trip); after
//! the first pushback it grows by a tenth of a call per returned call (a tenth more every round
//! trip). The doubling is for slow calls: a burst of one-second calls waited a round trip for
//! each step of growth when returned calls alone drove it, and a provider that refuses what it
//! cannot take does so at once, well within a [`PROBE`], so the doubling stops at the first
//! refusal and overshoots at most twice what the provider takes. A pushback (a 429, a 503, a
//! 5xx, a timeout, a broken connection: every error the breaker counts as a failure) takes it
//! down to seven tenths ([`BACK_OFF`]), once per round trip: only a call sent after the last
//! decrease can cause the next one. It stays within [`AUTO_MIN`] and [`AUTO_MAX`].
//! Latency is no signal here: a model call's length follows its answer, not the provider's
//! queue. A provider that queues without pushing back (a local server with one slot) is given
//! a number instead (docs/models.md).
//!
//! Waiting calls are granted in turn by tenant: a freed call slot goes to the next tenant in a
//! ring of those with a call waiting, so a tenant with a thousand calls queued delays another's
//! one call by a single grant, and tenants that keep the gate full share it equally. Turns wait
//! for calls to return, and a tenant's calls may be slow (or held for minutes by a hostile
//! provider of its own): so a tenant with a quarter of the limit in flight takes more only while
//! an eighth of it stays free ([`SHARE`], [`RESERVE`]), which another tenant below its quarter
//! takes at once. A lone tenant gets seven eighths of the limit, and a found limit grows while
//! that holds its calls back. A tenant's hard cap (`AGENTQ_MODEL_TENANT_CONCURRENCY`) is there
//! for a deployment that wants one.
//!
//! A waiting call is a oneshot receiver; a grant sends it a [`Permit`]. A call dropped while it
//! waits (its operation cancelled) leaves a sender whose grant fails, and the grant moves on;
//! one dropped after its grant drops the permit, which gives the slot back.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use agentq_core::config::CallLimit;
use agentq_core::metrics;
use tokio::sync::oneshot;

/// Where a found limit starts.
pub const AUTO_START: usize = 256;
/// The least a found limit falls to.
pub const AUTO_MIN: usize = 4;
/// The most a found limit grows to: with about 78 KiB of a worker's memory per operation in a
/// call, under the 300 MiB a worker may take (docs/benchmarks.md, "A found model-call limit").
pub const AUTO_MAX: usize = 3584;
/// What a pushback leaves of a found limit: the gate then runs between seven tenths of what the
/// provider takes and all of it, not between half and all.
pub const BACK_OFF: f64 = 0.7;
/// How often a full gate with calls waiting doubles its found limit until the provider first
/// pushes back: long enough for a refusal sent at once to come back (a 429 or a 503 takes a
/// round trip of the network, not of the model), short enough that a burst of slow calls
/// reaches the ceiling within a second.
pub const PROBE: Duration = Duration::from_millis(200);
/// Growth per returned call until the provider first pushes back: about three times as many
/// calls each round trip (seven eighths of the limit return per round trip with one tenant).
const START_STEP: f64 = 2.0;
/// Growth per returned call once the provider has pushed back: a tenth more per round trip.
const AVOIDANCE_STEP: f64 = 0.1;
/// The part of the limit a tenant fills before it must leave [`RESERVE`] free.
pub const SHARE: f64 = 0.25;
/// The part of the limit (rounded down) a tenant past its [`SHARE`] leaves free for others.
pub const RESERVE: usize = 8;

/// The model calls of one worker in flight, and those waiting for one.
pub struct Limiter {
    state: Mutex<State>,
    adaptive: bool,
    per_tenant: Option<usize>,
    /// The provider, as the limit's metric names it.
    provider: String,
}

struct State {
    limit: f64,
    /// Growth is by one per call below it, by [`AVOIDANCE_STEP`] above it; the limit after
    /// the latest pushback (infinite before the first).
    threshold: f64,
    in_flight: usize,
    /// Decreases so far: a call granted before the latest one cannot cause another.
    generation: u64,
    /// Whether a task doubles the limit every [`PROBE`] (`Limiter::probe`).
    probing: bool,
    tenants: HashMap<String, Tenant>,
    /// Tenants with a call waiting, in the order they are granted.
    ring: VecDeque<String>,
}

#[derive(Default)]
struct Tenant {
    in_flight: usize,
    waiting: VecDeque<oneshot::Sender<Permit>>,
}

/// A call slot, held until the call returns.
pub struct Permit {
    limiter: Arc<Limiter>,
    tenant: String,
    generation: u64,
    /// Whether dropping it gives a slot back (a grant that found no one to take it did not).
    armed: bool,
}

impl Limiter {
    pub fn new(limit: CallLimit, per_tenant: Option<usize>, provider: String) -> Arc<Self> {
        let (start, adaptive) = match limit {
            CallLimit::Fixed(n) => (n.max(1), false),
            CallLimit::Auto => (AUTO_START, true),
        };
        metrics::MODEL_CALL_LIMIT.set(&[&provider], start as f64);
        Arc::new(Self {
            state: Mutex::new(State {
                limit: start as f64,
                threshold: f64::INFINITY,
                in_flight: 0,
                generation: 0,
                probing: false,
                tenants: HashMap::new(),
                ring: VecDeque::new(),
            }),
            adaptive,
            per_tenant: per_tenant.map(|n| n.max(1)),
            provider,
        })
    }

    /// Waits for a call slot for `tenant`'s call.
    pub async fn acquire(self: &Arc<Self>, tenant: &str) -> Permit {
        let waiting = {
            let mut s = self.state.lock().expect("limiter lock");
            let queued = s.tenants.get(tenant).is_some_and(|t| !t.waiting.is_empty());
            if !queued && self.admits(&s, tenant) {
                return self.grant(&mut s, tenant);
            }
            let (tx, rx) = oneshot::channel();
            s.tenants
                .entry(tenant.to_string())
                .or_default()
                .waiting
                .push_back(tx);
            if !s.ring.iter().any(|t| t == tenant) {
                s.ring.push_back(tenant.to_string());
            }
            if self.adaptive && !s.probing && s.threshold.is_infinite() {
                s.probing = true;
                tokio::spawn(Self::probe(Arc::downgrade(self)));
            }
            rx
        };
        waiting
            .await
            .expect("a waiting call's sender is dropped only by a grant")
    }

    /// [`Limiter::acquire`] with the tenant's name moved in (a future that borrows nothing of
    /// the caller's).
    #[cfg(test)]
    async fn acquire_owned(self: &Arc<Self>, tenant: String) -> Permit {
        self.acquire(&tenant).await
    }

    /// The limit now (rounded down), and the calls in flight.
    #[cfg(test)]
    fn now(&self) -> (usize, usize) {
        let s = self.state.lock().expect("limiter lock");
        (s.limit as usize, s.in_flight)
    }

    fn admits(&self, s: &State, tenant: &str) -> bool {
        let own = s.tenants.get(tenant).map_or(0, |t| t.in_flight);
        let limit = s.limit as usize;
        if s.in_flight >= limit || self.per_tenant.is_some_and(|cap| own >= cap) {
            return false;
        }
        own < (limit as f64 * SHARE).ceil() as usize || s.in_flight + 1 + limit / RESERVE <= limit
    }

    /// Full: no slot free, or only the reserve a tenant past its share must leave.
    fn full(s: &State) -> bool {
        let limit = s.limit as usize;
        s.in_flight + limit / RESERVE >= limit
    }

    /// Sets a found limit, within its bounds, and grants what it frees.
    fn grow_to(self: &Arc<Self>, s: &mut State, limit: f64) {
        let before = s.limit as usize;
        s.limit = limit.min(AUTO_MAX as f64);
        if s.limit as usize != before {
            metrics::MODEL_CALL_LIMIT.set(&[&self.provider], s.limit.floor());
            self.dispatch(s);
        }
    }

    /// Until the provider first pushes back, doubles the limit every [`PROBE`] while the gate
    /// is full and a call waits; ends when none waits or after a pushback (the next call that
    /// waits before any pushback starts it again).
    async fn probe(limiter: Weak<Limiter>) {
        loop {
            tokio::time::sleep(PROBE).await;
            let Some(l) = limiter.upgrade() else {
                return;
            };
            let mut s = l.state.lock().expect("limiter lock");
            if s.ring.is_empty() || s.threshold.is_finite() {
                s.probing = false;
                return;
            }
            if Self::full(&s) {
                let doubled = s.limit * 2.0;
                l.grow_to(&mut s, doubled);
            }
        }
    }

    /// Counts a call slot as `tenant`'s, and makes its permit.
    fn grant(self: &Arc<Self>, s: &mut State, tenant: &str) -> Permit {
        s.in_flight += 1;
        s.tenants.entry(tenant.to_string()).or_default().in_flight += 1;
        Permit {
            limiter: self.clone(),
            tenant: tenant.to_string(),
            generation: s.generation,
            armed: true,
        }
    }

    /// Grants freed slots to waiting calls, a tenant at a time in ring order.
    fn dispatch(self: &Arc<Self>, s: &mut State) {
        let mut passed = 0;
        while s.in_flight < s.limit as usize && passed < s.ring.len() {
            let Some(tenant) = s.ring.pop_front() else {
                break;
            };
            if !self.admits(s, &tenant) {
                // At its own cap: its turn waits for one of its calls to return.
                s.ring.push_back(tenant);
                passed += 1;
                continue;
            }
            let mut granted = false;
            while let Some(tx) = s
                .tenants
                .get_mut(&tenant)
                .and_then(|t| t.waiting.pop_front())
            {
                let permit = self.grant(s, &tenant);
                match tx.send(permit) {
                    Ok(()) => {
                        granted = true;
                        break;
                    }
                    Err(mut unsent) => {
                        // Its call was dropped while it waited: undo the grant, try the next.
                        unsent.armed = false;
                        s.in_flight -= 1;
                        if let Some(t) = s.tenants.get_mut(&tenant) {
                            t.in_flight -= 1;
                        }
                    }
                }
            }
            let waits = s
                .tenants
                .get(&tenant)
                .is_some_and(|t| !t.waiting.is_empty());
            if waits {
                s.ring.push_back(tenant.clone());
            }
            Self::forget_if_idle(s, &tenant);
            passed = if granted { 0 } else { passed + 1 };
        }
    }

    fn forget_if_idle(s: &mut State, tenant: &str) {
        if s.tenants
            .get(tenant)
            .is_some_and(|t| t.in_flight == 0 && t.waiting.is_empty())
        {
            s.tenants.remove(tenant);
        }
    }

    fn release(self: &Arc<Self>, tenant: &str) {
        let mut s = self.state.lock().expect("limiter lock");
        s.in_flight -= 1;
        if let Some(t) = s.tenants.get_mut(tenant) {
            t.in_flight -= 1;
        }
        Self::forget_if_idle(&mut s, tenant);
        self.dispatch(&mut s);
    }

    /// A call returned without pushback: a full gate, with a call waiting, grows.
    fn returned(self: &Arc<Self>) {
        if !self.adaptive {
            return;
        }
        let mut s = self.state.lock().expect("limiter lock");
        if s.ring.is_empty() || !Self::full(&s) {
            return;
        }
        let step = if s.limit < s.threshold {
            START_STEP
        } else {
            AVOIDANCE_STEP
        };
        let grown = s.limit + step;
        self.grow_to(&mut s, grown);
    }

    /// The provider pushed back on a call granted in `generation`: come down to [`BACK_OFF`]
    /// of the limit, once per round trip.
    /// Whether it is news: a fixed limit's every pushback is; a found limit's only when it came
    /// down for it (a call sent before the latest decrease only repeats what that one said).
    fn pushed_back(&self, generation: u64) -> bool {
        if !self.adaptive {
            return true;
        }
        let mut s = self.state.lock().expect("limiter lock");
        if generation != s.generation {
            return false;
        }
        let before = s.limit;
        s.limit = (s.limit * BACK_OFF).max(AUTO_MIN as f64);
        s.threshold = s.limit;
        s.generation += 1;
        metrics::MODEL_CALL_LIMIT.set(&[&self.provider], s.limit.floor());
        tracing::debug!(
            provider = %self.provider,
            from = before as usize,
            to = s.limit as usize,
            "the provider pushed back: fewer model calls at once"
        );
        true
    }
}

impl Permit {
    /// Gives the slot back and waits for another for the same tenant, behind the calls that
    /// wait now (a call sent again after a pushback).
    pub async fn again(self) -> Permit {
        let (limiter, tenant) = (self.limiter.clone(), self.tenant.clone());
        drop(self);
        limiter.acquire(&tenant).await
    }

    /// The call returned an answer.
    pub fn returned(&self) {
        self.limiter.returned();
    }

    /// The call failed as the provider's pushback (rate limited, overloaded, failed, timed
    /// out); whether that is news for the breaker (see [`Limiter`]'s `pushed_back`).
    pub fn pushed_back(&self) -> bool {
        self.limiter.pushed_back(self.generation)
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.armed {
            self.limiter.release(&self.tenant);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(limit: CallLimit, per_tenant: Option<usize>) -> Arc<Limiter> {
        Limiter::new(limit, per_tenant, "test".into())
    }

    /// Polls `f` once: `Some` if it finished.
    fn ready<T>(f: &mut (impl Future<Output = T> + Unpin)) -> Option<T> {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        match std::pin::Pin::new(f).poll(&mut cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }

    #[tokio::test]
    async fn a_fixed_limit_holds_and_freed_slots_go_to_tenants_in_turn() {
        let l = limiter(CallLimit::Fixed(2), None);
        let a1 = l.acquire("a").await;
        let a2 = l.acquire("a").await;
        // Tenant a queues three more, then b one: b's goes second, not fourth.
        let mut a3 = Box::pin(l.acquire("a"));
        let mut a4 = Box::pin(l.acquire("a"));
        let mut a5 = Box::pin(l.acquire("a"));
        let mut b1 = Box::pin(l.acquire("b"));
        for f in [&mut a3, &mut a4, &mut a5, &mut b1] {
            assert!(ready(f).is_none(), "the limit is 2");
        }
        drop(a1);
        let a3 = ready(&mut a3).expect("a's turn first");
        assert!(ready(&mut b1).is_none());
        drop(a2);
        let b1 = ready(&mut b1).expect("then b's, before a's next");
        assert!(ready(&mut a4).is_none());
        drop(a3);
        let a4 = ready(&mut a4).expect("then a's again");
        assert_eq!(l.now(), (2, 2));
        // A call dropped while it waits gives its turn to the next.
        drop(a5);
        drop(b1);
        assert_eq!(l.now(), (2, 1));
        drop(a4);
        assert_eq!(l.now(), (2, 0));
        assert!(
            l.state.lock().unwrap().tenants.is_empty(),
            "idle tenants forgotten"
        );
    }

    #[tokio::test]
    async fn a_tenants_cap_holds_while_another_tenant_goes() {
        let l = limiter(CallLimit::Fixed(4), Some(1));
        let a1 = l.acquire("a").await;
        let mut a2 = Box::pin(l.acquire("a"));
        assert!(ready(&mut a2).is_none(), "a is at its cap of 1");
        let b1 = l.acquire("b").await;
        assert_eq!(l.now(), (4, 2));
        drop(b1);
        assert!(ready(&mut a2).is_none(), "a slot of the gate, not of a");
        drop(a1);
        let _a2 = ready(&mut a2).expect("a's own slot back");
    }

    /// `n` calls of `n` tenants (none past its share), granted at once.
    async fn calls(l: &Arc<Limiter>, n: usize, from: usize) -> Vec<Permit> {
        futures_util::future::join_all(
            (from..from + n).map(|i| async move { l.acquire(&format!("t{i}")).await }),
        )
        .await
    }

    #[tokio::test]
    async fn a_found_limit_grows_while_full_and_backs_off_once_per_round_trip() {
        let l = limiter(CallLimit::Auto, None);
        assert_eq!(l.now().0, AUTO_START);
        // Not full: calls that return grow nothing.
        let p = l.acquire("a").await;
        p.returned();
        drop(p);
        assert_eq!(l.now().0, AUTO_START);
        // Full with more waiting, and every call returns: two more per call, three times as
        // many per round trip, each granted at once to a call that waits.
        let mut waiting: Vec<_> = (0..4 * AUTO_START)
            .map(|i| Box::pin(l.acquire_owned(format!("w{i}"))))
            .collect();
        let first: Vec<Permit> = waiting.iter_mut().filter_map(ready).collect();
        assert_eq!(first.len(), AUTO_START);
        for p in &first {
            p.returned();
        }
        assert_eq!(
            l.now(),
            (3 * AUTO_START, 3 * AUTO_START),
            "the growth was granted"
        );
        drop(first);
        drop(waiting);
        assert_eq!(l.now(), (3 * AUTO_START, 0), "every slot given back");

        let l = limiter(CallLimit::Auto, None);
        // Pushback from two calls of one round trip backs off once.
        let round = calls(&l, 8, 0).await;
        assert!(round[0].pushed_back(), "news");
        assert!(!round[1].pushed_back(), "the same round trip's");
        let once = AUTO_START as f64 * BACK_OFF;
        assert_eq!(l.now().0, once as usize);
        // A call granted after the decrease can bring it down again.
        let after = l.acquire("a").await;
        assert!(after.pushed_back());
        let twice = (once * BACK_OFF) as usize;
        assert_eq!(l.now().0, twice);
        drop((round, after));
        // Past the first pushback a full gate grows by a tenth of a call per returned call:
        // ten returned calls make room for one more, granted to the call that waits.
        let full = calls(&l, twice, 0).await;
        let mut more = Box::pin(l.acquire("more"));
        assert!(ready(&mut more).is_none());
        for p in full.iter().take(10) {
            p.returned();
        }
        assert_eq!(l.now().0, twice + 1);
        let _more = ready(&mut more).expect("the growth granted");
        drop(full);
        // Never below the floor.
        for _ in 0..20 {
            assert!(l.acquire("a").await.pushed_back());
        }
        assert_eq!(l.now().0, AUTO_MIN);
    }

    /// Until the first pushback, a gate full with calls waiting doubles every [`PROBE`] without
    /// a call returning; after it, only returned calls grow it.
    #[tokio::test(start_paused = true)]
    async fn a_found_limit_doubles_while_calls_wait_until_the_first_pushback() {
        let l = limiter(CallLimit::Auto, None);
        // Unconstrained: a task's budget would stop its polls of granted calls at 128.
        let mut waiting: Vec<_> = (0..2 * AUTO_MAX)
            .map(|i| Box::pin(tokio::task::unconstrained(l.acquire_owned(format!("w{i}")))))
            .collect();
        let mut held: Vec<Permit> = Vec::new();
        let mut grant = |held: &mut Vec<Permit>| {
            waiting.retain_mut(|f| match ready(f) {
                Some(p) => {
                    held.push(p);
                    false
                }
                None => true,
            });
        };
        grant(&mut held);
        assert_eq!(held.len(), AUTO_START);
        // A probe's time later (just past it, so that the probe has run): twice as many.
        let tick = PROBE + Duration::from_millis(1);
        for expected in [2 * AUTO_START, 4 * AUTO_START, 8 * AUTO_START, AUTO_MAX] {
            tokio::time::sleep(tick).await;
            grant(&mut held);
            assert_eq!(l.now(), (expected, expected), "doubled and granted");
            assert_eq!(held.len(), expected);
        }
        tokio::time::sleep(tick).await;
        assert_eq!(l.now().0, AUTO_MAX, "never past the ceiling");
        // The first pushback ends the doubling.
        assert!(held[0].pushed_back());
        let after = (AUTO_MAX as f64 * BACK_OFF) as usize;
        assert_eq!(l.now().0, after);
        drop(held.drain(..AUTO_MAX - after + 10).collect::<Vec<_>>());
        grant(&mut held);
        assert_eq!(l.now(), (after, after), "full again, calls waiting");
        tokio::time::sleep(5 * tick).await;
        assert_eq!(l.now().0, after, "no doubling after a pushback");
        drop(held);
        drop(waiting);

        // A gate with no call waiting does not grow: one waited (the doubling began), then
        // a call returned without growth (`Permit::returned` was not called) and it had a slot.
        let l = limiter(CallLimit::Auto, None);
        let mut held = calls(&l, AUTO_START, 0).await;
        let mut last = Box::pin(tokio::task::unconstrained(l.acquire_owned("last".into())));
        assert!(ready(&mut last).is_none(), "full: it waits");
        held.pop();
        let _last = ready(&mut last).expect("granted the freed slot");
        tokio::time::sleep(5 * tick).await;
        assert_eq!(l.now(), (AUTO_START, AUTO_START));
        drop(held);
    }

    #[tokio::test]
    async fn a_tenant_past_its_share_leaves_a_reserve_that_another_takes_at_once() {
        let l = limiter(CallLimit::Fixed(16), None);
        // A lone tenant fills all but an eighth.
        let (mut held, mut waiting) = (Vec::new(), Vec::new());
        for mut call in (0..16).map(|_| Box::pin(l.acquire("a"))) {
            match ready(&mut call) {
                Some(p) => held.push(p),
                None => waiting.push(call),
            }
        }
        assert_eq!(held.len(), 14);
        // Another takes the reserve at once, ahead of a's waiting calls.
        let b1 = l.acquire("b").await;
        let b2 = l.acquire("b").await;
        assert_eq!(l.now(), (16, 16));
        // a's calls back: their slots go to a's that waited (b holds the reserve).
        drop(held);
        let again: Vec<Permit> = waiting.iter_mut().filter_map(ready).collect();
        assert_eq!(again.len(), 2, "a's two that waited");
        drop((b1, b2, again));
        assert_eq!(l.now(), (16, 0));
    }
}
