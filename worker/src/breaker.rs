//! A circuit breaker for one thing a worker calls: a model provider (`crate::gate`) or a
//! registered service (`crate::remote`). It opens after a burst of failures; while it is open,
//! calls are refused at once with the time it may close, and their operations are parked (the
//! attempt given back) instead of hammering what is down. After the cool-down it lets one
//! probe through, then ramps (1, 2, 4, 8 calls at once) and closes after a few successes; a
//! failure re-opens it for twice as long.
//!
//! Invariant kept here: a probe admitted while half-open is given back however its call ends
//! (settled, or its future dropped), so the breaker can never stay half-open with a probe
//! counted that nobody will finish.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Successes in half-open state that close the breaker.
pub(crate) const CLOSE_AFTER: u32 = 4;

/// When a breaker opens and for how long.
#[derive(Clone, Copy, Debug)]
pub struct BreakerSettings {
    /// Consecutive failures that open it.
    pub failure_threshold: u32,
    /// First cool-down; doubles on each failed probe, up to `max_cooldown`.
    pub cooldown: Duration,
    pub max_cooldown: Duration,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            cooldown: Duration::from_secs(5),
            max_cooldown: Duration::from_secs(60),
        }
    }
}

#[derive(Debug)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
        cooldown: Duration,
    },
    HalfOpen {
        /// Which half-open period this is (each one counts its own probes).
        generation: u64,
        in_flight: u32,
        successes: u32,
        cooldown: Duration,
    },
}

/// How a call ended, for the breaker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    /// An answer that says nothing about the callee's health.
    Neutral,
    Failed,
}

/// One breaker: what it guards, named in its logs, and where its state is published (0 closed,
/// 1 half-open, 2 open).
pub struct Breaker {
    /// What it guards, for logs: `model` or `service`.
    subject: &'static str,
    /// Which one: the provider or the service's name.
    name: String,
    settings: BreakerSettings,
    state: Mutex<State>,
    /// Half-open periods so far.
    generations: AtomicU64,
    published: Box<dyn Fn(f64) + Send + Sync>,
}

/// A call the breaker let through; settle it with how it ended.
pub struct Admitted<'a> {
    breaker: &'a Breaker,
    /// The half-open period whose probe this is; `None` for a call admitted while closed.
    probe: Option<u64>,
}

impl Admitted<'_> {
    pub fn settle(mut self, outcome: Outcome) {
        let probe = self.probe.take();
        self.breaker.settle(probe, outcome);
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        if let Some(generation) = self.probe.take() {
            self.breaker.settle(Some(generation), Outcome::Neutral);
        }
    }
}

impl Breaker {
    /// A closed breaker for the `subject` (`model`, `service`) called `name`, publishing its
    /// state through `published`.
    pub fn new(
        subject: &'static str,
        name: String,
        settings: BreakerSettings,
        published: Box<dyn Fn(f64) + Send + Sync>,
    ) -> Self {
        published(0.0);
        Self {
            subject,
            name,
            settings,
            state: Mutex::new(State::Closed { failures: 0 }),
            generations: AtomicU64::new(0),
            published,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("breaker lock")
    }

    /// Its state, for logs, status lines and tests.
    pub fn describe(&self) -> String {
        match &*self.state() {
            State::Closed { failures } => format!("closed ({failures} recent failures)"),
            State::Open { until, .. } => format!(
                "open for {:?} more",
                until.saturating_duration_since(Instant::now())
            ),
            State::HalfOpen {
                in_flight,
                successes,
                ..
            } => {
                format!("half-open ({in_flight} probes in flight, {successes} succeeded)")
            }
        }
    }

    /// Lets a call through, or refuses it with how long to wait before trying again.
    pub fn admit(&self) -> Result<Admitted<'_>, Duration> {
        let mut state = self.state();
        let now = Instant::now();
        match &mut *state {
            State::Closed { .. } => Ok(Admitted {
                breaker: self,
                probe: None,
            }),
            State::Open { until, cooldown } if now >= *until => {
                tracing::info!(name = %self.name, "{} circuit half-open: probing", self.subject);
                let generation = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
                *state = State::HalfOpen {
                    generation,
                    in_flight: 1,
                    successes: 0,
                    cooldown: *cooldown,
                };
                (self.published)(1.0);
                Ok(Admitted {
                    breaker: self,
                    probe: Some(generation),
                })
            }
            State::Open { until, .. } => Err(until.saturating_duration_since(now)),
            State::HalfOpen {
                generation,
                in_flight,
                successes,
                ..
            } => {
                if *in_flight < 1 << (*successes).min(3) {
                    *in_flight += 1;
                    Ok(Admitted {
                        breaker: self,
                        probe: Some(*generation),
                    })
                } else {
                    Err(Duration::from_secs(1))
                }
            }
        }
    }

    /// Applies a call's outcome; `probe` is the half-open period it was a probe of, whose
    /// count of probes in flight it gives back (a probe of an earlier period counts nothing).
    fn settle(&self, probe: Option<u64>, outcome: Outcome) {
        let mut state = self.state();
        if let State::HalfOpen {
            generation,
            in_flight,
            ..
        } = &mut *state
            && probe == Some(*generation)
        {
            *in_flight = in_flight.saturating_sub(1);
        }
        let open_for = match (&mut *state, outcome) {
            (_, Outcome::Neutral) => None,
            (State::Closed { failures }, Outcome::Succeeded) => {
                *failures = 0;
                None
            }
            (State::HalfOpen { successes, .. }, Outcome::Succeeded) => {
                *successes += 1;
                if *successes >= CLOSE_AFTER {
                    tracing::info!(name = %self.name, "{} circuit closed", self.subject);
                    *state = State::Closed { failures: 0 };
                    (self.published)(0.0);
                }
                None
            }
            (State::Closed { failures }, Outcome::Failed) => {
                *failures += 1;
                (*failures >= self.settings.failure_threshold).then_some(self.settings.cooldown)
            }
            (State::HalfOpen { cooldown, .. }, Outcome::Failed) => {
                Some((*cooldown * 2).min(self.settings.max_cooldown))
            }
            (State::Open { .. }, _) => None,
        };
        if let Some(cooldown) = open_for {
            tracing::warn!(
                name = %self.name,
                ?cooldown,
                "{} circuit open: parking calls",
                self.subject
            );
            *state = State::Open {
                until: Instant::now() + cooldown,
                cooldown,
            };
            (self.published)(2.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_of_an_earlier_half_open_period_does_not_count_in_a_later_one() {
        let breaker = Breaker::new(
            "service",
            "s".into(),
            BreakerSettings::default(),
            Box::new(|_| {}),
        );
        *breaker.state() = State::HalfOpen {
            generation: 7,
            in_flight: 1,
            successes: 0,
            cooldown: Duration::from_secs(1),
        };
        breaker.settle(Some(6), Outcome::Neutral);
        let described = breaker.describe();
        assert!(described.starts_with("half-open (1"), "{described}");
        breaker.settle(Some(7), Outcome::Neutral);
        let described = breaker.describe();
        assert!(described.starts_with("half-open (0"), "{described}");
    }
}
