//! What one tenant may take of the deployment: the caps every way an operation is born from a
//! caller goes through ([`admit`]: an enqueue from the CLI, the API or a webhook delivery, a
//! batch), and the limits of schedules ([`check_schedules`]). Spawns and schedule firings are
//! born in the worker and the scheduler, which apply the same caps (`AGENTQ_TENANT_MAX_UNFINISHED`,
//! `AGENTQ_MAX_CHILDREN`) through `agentq_core::db`.
//!
//! Invariant kept here: a refusal writes nothing and says which cap, its value, and what to do.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use agentq_core::db;

use crate::{App, AppError, Result};

/// How long a tenant's count of unfinished operations is trusted before counting again: one
/// request refreshes a stale count while the others use the previous one (a count under load
/// costs milliseconds to tens of them, and every request running its own would scan the same
/// index hundreds of times a second).
const COUNT_TTL: Duration = Duration::from_secs(1);

/// The caps (`AGENTQ_TENANT_MAX_UNFINISHED`, `AGENTQ_MAX_CHILDREN`,
/// `AGENTQ_TENANT_MAX_SCHEDULES`, `AGENTQ_SCHEDULE_MIN_INTERVAL_SECS`,
/// `AGENTQ_TENANT_MAX_PAUSES`).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Unfinished operations (queued, running, sleeping, waiting) per tenant.
    pub tenant_max_unfinished: i64,
    /// Children one operation may spawn.
    pub max_children: i64,
    /// Schedules per tenant.
    pub tenant_max_schedules: i64,
    /// Pauses in force per tenant (the deployment's own, naming no tenant, count as one more).
    pub tenant_max_pauses: i64,
    /// Shortest time between two firings of a schedule.
    pub schedule_min_interval: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            tenant_max_unfinished: 100_000,
            max_children: 10_000,
            tenant_max_schedules: 100,
            tenant_max_pauses: 100,
            schedule_min_interval: Duration::from_secs(10),
        }
    }
}

struct Counted {
    at: Instant,
    n: i64,
    /// A caller is counting anew; the others keep using `n` meanwhile.
    refreshing: bool,
}

/// Tenants' counts of unfinished operations, each at most a second old.
#[derive(Default)]
pub struct Counts {
    map: Mutex<HashMap<String, Counted>>,
}

impl Counts {
    /// `tenant`'s unfinished operations, counted up to `cap + 1`.
    async fn unfinished(&self, pool: &sqlx::PgPool, tenant: &str, cap: i64) -> Result<i64> {
        let stale = {
            let mut map = self.map.lock().expect("counts lock");
            match map.get_mut(tenant) {
                Some(c) if c.at.elapsed() < COUNT_TTL || c.refreshing => return Ok(c.n),
                Some(c) => {
                    c.refreshing = true;
                    Some(c.n)
                }
                None => None,
            }
        };
        let counted = db::operations::unfinished_count(pool, tenant, cap).await;
        let mut map = self.map.lock().expect("counts lock");
        match counted {
            Ok(n) => {
                map.insert(
                    tenant.to_string(),
                    Counted {
                        at: Instant::now(),
                        n,
                        refreshing: false,
                    },
                );
                Ok(n)
            }
            Err(e) => {
                if let Some(c) = map.get_mut(tenant) {
                    c.refreshing = false;
                }
                // A count that failed keeps the last one rather than refusing everyone.
                stale.ok_or(AppError::Db(e))
            }
        }
    }
}

/// Admits `n` new operations of `kind` for `tenant`, or refuses them all (nothing written)
/// when an admin's list keeps the kind from the tenant ([`crate::tenants::check_kind`]) or
/// they would take it past `AGENTQ_TENANT_MAX_UNFINISHED`. The count may be a second old: a
/// burst can pass the cap by what it enqueues within that second, never by more.
pub async fn admit(app: &App, tenant: &str, kind: &str, n: i64) -> Result<()> {
    crate::tenants::check_kind(app, tenant, kind).await?;
    let cap = app.settings.limits.tenant_max_unfinished;
    let count = app.counts.unfinished(&app.pool, tenant, cap).await?;
    if count + n > cap {
        let have = if count > cap {
            format!("more than {cap}")
        } else {
            count.to_string()
        };
        return Err(AppError::Busy {
            message: format!(
                "tenant {tenant:?} has {have} unfinished operations and may have at most {cap} \
                 (AGENTQ_TENANT_MAX_UNFINISHED); {} not started: retry once some have finished",
                if n == 1 {
                    "this one was".to_string()
                } else {
                    format!("these {n} were")
                }
            ),
            retry_after_secs: 5,
        });
    }
    Ok(())
}

/// Checks a new schedule of `tenant` whose closest two firings are `gap` apart (`field`: the
/// field that says so, `/cron` or `/interval_secs`) against the limits: the shortest interval,
/// and its tenant's count of schedules (checked when it is added: two added at the same
/// moment may both pass).
pub async fn check_schedules(app: &App, tenant: &str, gap: Duration, field: &str) -> Result<()> {
    let limits = &app.settings.limits;
    if gap < limits.schedule_min_interval {
        return Err(AppError::invalid(
            field,
            format!(
                "the schedule would fire every {} s; the shortest interval is {} s \
                 (AGENTQ_SCHEDULE_MIN_INTERVAL_SECS)",
                gap.as_secs(),
                limits.schedule_min_interval.as_secs()
            ),
        ));
    }
    let have = db::schedules::count_of(&app.pool, tenant).await?;
    if have >= limits.tenant_max_schedules {
        return Err(AppError::Busy {
            message: format!(
                "tenant {tenant:?} has {have} schedules and may have at most {} \
                 (AGENTQ_TENANT_MAX_SCHEDULES): delete one first",
                limits.tenant_max_schedules
            ),
            retry_after_secs: 0,
        });
    }
    Ok(())
}
