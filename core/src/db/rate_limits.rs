//! SQL of rate limits (`rate_limits`, `rate_usage`): tokens and requests of model calls per
//! window, for a provider or one of its models, a tenant, or a key operations name, shared by
//! every worker through PostgreSQL.
//!
//! Invariants kept here:
//! - A call is sent only within a grant: room its worker process reserved (estimate units
//!   times each limit's learned ratio) in every limit over it, in one statement that locks
//!   those limit rows before it reads their windows. Grants on one limit from every worker are
//!   serialized there, so the grants in any window never pass its limit; a process hands a
//!   grant out only until its bucket ends.
//! - A grant is settled when its bucket ends: its unused part is returned and its calls'
//!   reported usage replaces their share (their estimate stays when none was reported). A call
//!   that used more than its share raises the limit's ratio, so later grants count more; only
//!   calls already sent can have been counted short (see docs/rate-limits.md).
//! - A refused call changes no usage (it records its tenant as waiting on the limit).
//! - While other tenants wait on a limit, its room goes to them in turn, one call each
//!   (`rate_waiters`, `last_tenant`; migration `20261209000003_rate_limit_turns.sql`).
//! - Setting or removing a limit makes the operations parked on it due at once; parked
//!   operations are matched to a limit by its id, never by its label.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;

/// What an operation a rate limit parked is stored as waiting for (`waiting_for`), naming the
/// limit (by its id, which is what a settlement or a change of the limit wakes it by, and as
/// people know it) and when its window reopens:
/// `(rate limit <id> <scope> <label> <RFC 3339 time>)`. In parentheses, as `(budget)` is:
/// never a signal's name.
pub fn waiting_for(limit: &Target, reopens_at: DateTime<Utc>) -> String {
    format!(
        "{WAITING_PREFIX}{} {} {} {})",
        limit.id,
        limit.scope.as_str(),
        limit.label(),
        reopens_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    )
}

const WAITING_PREFIX: &str = "(rate limit ";

/// The limit a [`waiting_for`] value names (scope, label) and when its window reopens, if it
/// is one.
pub fn parse_waiting_for(value: &str) -> Option<(String, String, DateTime<Utc>)> {
    parse_parked(value).map(|(_, scope, label, at)| (scope, label, at))
}

/// The id of the limit a [`waiting_for`] value names, if it is one.
pub fn parked_on(value: &str) -> Option<Uuid> {
    parse_parked(value).map(|(id, ..)| id)
}

fn parse_parked(value: &str) -> Option<(Uuid, String, String, DateTime<Utc>)> {
    let rest = value.strip_prefix(WAITING_PREFIX)?.strip_suffix(')')?;
    let (id, rest) = rest.split_once(' ')?;
    let id = id.parse().ok()?;
    let (scope, rest) = rest.split_once(' ')?;
    let (label, at) = rest.rsplit_once(' ')?;
    let at = DateTime::parse_from_rfc3339(at).ok()?.with_timezone(&Utc);
    Some((id, scope.to_string(), label.to_string(), at))
}

/// What a limit is over.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
#[schemars(rename = "LimitScope")]
pub enum Scope {
    /// Calls to a model (name: the model), to a provider (its host), or to one model there
    /// (`<host>/<model>`).
    Model,
    /// A tenant's calls (name: the tenant).
    Tenant,
    /// The calls of a tenant's operations that name it as their `rate_key`.
    Key,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Model => "model",
            Scope::Tenant => "tenant",
            Scope::Key => "key",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "model" => Some(Scope::Model),
            "tenant" => Some(Scope::Tenant),
            "key" => Some(Scope::Key),
            _ => None,
        }
    }
}

/// A limit as a worker matches calls against it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub id: Uuid,
    pub scope: Scope,
    pub name: String,
    /// The tenant whose operations' key it is (scope `key`); empty otherwise.
    pub tenant: String,
}

impl Target {
    /// Whether a call of `tenant`'s operation (naming `rate_key`) to `model` at the provider
    /// whose host is `host` counts against this limit. A model-scope limit names the model, the
    /// host (every model there), or `<host>/<model>`.
    pub fn covers(&self, tenant: &str, rate_key: Option<&str>, host: &str, model: &str) -> bool {
        match self.scope {
            Scope::Model => {
                self.name == model
                    || self.name == host
                    || self
                        .name
                        .strip_prefix(host)
                        .and_then(|rest| rest.strip_prefix('/'))
                        == Some(model)
            }
            Scope::Tenant => self.name == tenant,
            Scope::Key => self.tenant == tenant && rate_key == Some(self.name.as_str()),
        }
    }

    /// How it is named to people: `<name>`, or `<tenant>:<key>` for a key.
    pub fn label(&self) -> String {
        match self.scope {
            Scope::Key => format!("{}:{}", self.tenant, self.name),
            _ => self.name.clone(),
        }
    }
}

/// Every limit, as workers match calls against them (a small table, read whole).
pub async fn targets(pool: &PgPool) -> Result<Vec<Target>> {
    let rows: Vec<(Uuid, String, String, String)> =
        sqlx::query_as("SELECT id, scope, name, tenant_id FROM rate_limits ORDER BY id")
            .fetch_all(pool)
            .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(id, scope, name, tenant)| {
            Some(Target {
                id,
                scope: Scope::parse(&scope)?,
                name,
                tenant,
            })
        })
        .collect())
}

/// What a limit caps: tokens and/or requests in any window of `window_secs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    pub scope: Scope,
    pub name: String,
    /// The tenant whose key it is (scope `key`); ignored otherwise.
    pub tenant: String,
    pub window_secs: i32,
    pub max_tokens: Option<i64>,
    pub max_requests: Option<i64>,
}

/// A limit and what its current window holds.
#[derive(Clone, Debug, PartialEq, FromRow, serde::Serialize, schemars::JsonSchema)]
pub struct LimitView {
    #[schemars(with = "String")]
    pub id: Uuid,
    /// `model`, `tenant` or `key`.
    pub scope: String,
    pub name: String,
    /// The tenant whose operations' key it is (scope `key`); empty otherwise.
    pub tenant: String,
    pub window_secs: i32,
    pub max_tokens: Option<i64>,
    pub max_requests: Option<i64>,
    /// Tokens granted or used in the last window (grants not yet settled whole, settled ones
    /// at their calls' reported usage).
    pub window_tokens: i64,
    /// Calls sent in the last window.
    pub window_requests: i64,
    /// Reservations are a call's estimate times this (≥ 1): the largest recent ratio of a
    /// call's reported usage to its estimate.
    pub usage_ratio: f64,
    pub updated_at: DateTime<Utc>,
}

const VIEW: &str = "l.id, l.scope, l.name, l.tenant_id AS tenant, l.window_secs, l.max_tokens,
     l.max_requests, l.usage_ratio, l.updated_at,
     coalesce(w.tokens, 0)::bigint AS window_tokens,
     coalesce(w.requests, 0)::bigint AS window_requests";

/// The window's sums as the reservation reads them (its 100 buckets and the current one).
const WINDOW_JOIN: &str = "LEFT JOIN LATERAL (
        SELECT sum(u.tokens) AS tokens, sum(u.requests) AS requests FROM rate_usage u
         WHERE u.limit_id = l.id
           AND u.bucket >= floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint
                           / (l.window_secs * 10) - 100) w ON true";

/// Sets (creates or replaces) a limit, audited as `rate_limit_set` by `actor`; its window's
/// usage is kept.
pub async fn set(
    pool: &PgPool,
    spec: &Spec,
    actor: &str,
    reason: Option<&str>,
) -> Result<LimitView> {
    let tenant = if spec.scope == Scope::Key {
        spec.tenant.as_str()
    } else {
        ""
    };
    let mut tx = pool.begin().await?;
    let id: Uuid = sqlx::query_scalar(
        "INSERT INTO rate_limits (id, scope, name, tenant_id, window_secs, max_tokens,
                                  max_requests)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (scope, tenant_id, name)
         DO UPDATE SET window_secs = EXCLUDED.window_secs, max_tokens = EXCLUDED.max_tokens,
                       max_requests = EXCLUDED.max_requests, updated_at = now()
         RETURNING id",
    )
    .bind(Uuid::new_v4())
    .bind(spec.scope.as_str())
    .bind(&spec.name)
    .bind(tenant)
    .bind(spec.window_secs)
    .bind(spec.max_tokens)
    .bind(spec.max_requests)
    .fetch_one(&mut *tx)
    .await?;
    let view: LimitView = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {VIEW} FROM rate_limits l {WINDOW_JOIN} WHERE l.id = $1"
    )))
    .bind(id)
    .fetch_one(&mut *tx)
    .await?;
    let details = serde_json::json!({
        "scope": view.scope, "name": view.name, "tenant": view.tenant,
        "window_secs": view.window_secs, "max_tokens": view.max_tokens,
        "max_requests": view.max_requests, "reason": reason,
    });
    super::access::audit(&mut tx, actor, "rate_limit_set", details).await?;
    wake_parked(&mut tx, id).await?;
    tx.commit().await?;
    Ok(view)
}

/// Removes a limit, audited as `rate_limit_delete` by `actor`; whether there was one.
pub async fn delete(
    pool: &PgPool,
    scope: Scope,
    tenant: &str,
    name: &str,
    actor: &str,
) -> Result<bool> {
    let tenant = if scope == Scope::Key { tenant } else { "" };
    let mut tx = pool.begin().await?;
    let gone: Option<Uuid> = sqlx::query_scalar(
        "DELETE FROM rate_limits WHERE scope = $1 AND tenant_id = $2 AND name = $3 RETURNING id",
    )
    .bind(scope.as_str())
    .bind(tenant)
    .bind(name)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(id) = gone {
        let details =
            serde_json::json!({ "scope": scope.as_str(), "name": name, "tenant": tenant });
        super::access::audit(&mut tx, actor, "rate_limit_delete", details).await?;
        wake_parked(&mut tx, id).await?;
    }
    tx.commit().await?;
    Ok(gone.is_some())
}

/// Makes the operations parked on the limit `id` (by [`waiting_for`], which names it) due now,
/// after it changed: they reserve again under the new limit (or none) rather than sleep out the
/// old window.
async fn wake_parked(tx: &mut sqlx::PgConnection, id: Uuid) -> Result<()> {
    let prefix = format!("{WAITING_PREFIX}{id} ");
    sqlx::query(
        "UPDATE operations SET run_at = now(), updated_at = now()
          WHERE status = 'waiting' AND waiting_for LIKE '(rate limit %'
            AND starts_with(waiting_for, $1) AND run_at > now()",
    )
    .bind(prefix)
    .execute(tx)
    .await?;
    Ok(())
}

/// Every limit with its window's usage; only `tenant`'s key limits (and the tenant's own
/// limit) when it is given.
pub async fn list(pool: &PgPool, tenant: Option<&str>) -> Result<Vec<LimitView>> {
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {VIEW} FROM rate_limits l {WINDOW_JOIN}
          WHERE $1::text IS NULL
             OR (l.scope = 'key' AND l.tenant_id = $1) OR (l.scope = 'tenant' AND l.name = $1)
          ORDER BY l.scope, l.tenant_id, l.name"
    )))
    .bind(tenant)
    .fetch_all(pool)
    .await?)
}

/// One limit's part of a grant: what [`reserve`] counted in it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Held {
    pub limit: Uuid,
    pub bucket: i64,
    /// Tokens counted in the bucket: the grant's units times `ratio`, rounded up.
    pub tokens: i64,
    /// Calls counted in the bucket.
    pub requests: i64,
    /// The limit's learned ratio of usage to estimate, as the grant was made.
    pub ratio: f64,
}

/// Room granted to a process for calls of about its estimate, in every limit asked, until its
/// bucket ends.
#[derive(Clone, Debug, PartialEq)]
pub struct Grant {
    pub held: Vec<Held>,
    /// Estimate units granted (at least the asking call's estimate).
    pub units: i64,
    /// How long until the bucket ends, by the database's clock.
    pub expires_in: std::time::Duration,
}

/// What [`reserve`] decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Reservation {
    /// Granted in every limit asked.
    Granted(Grant),
    /// A limit's window has no room for the call until `reopens_at` (the latest of the limits
    /// that refused), or sooner if `settling`: grants in flight in its window may return what
    /// their calls did not use. Nothing was reserved.
    Refused {
        limit: Uuid,
        reopens_at: DateTime<Utc>,
        settling: bool,
    },
    /// The call's reservation alone (`reserved` tokens) is more than limit `limit` allows in a
    /// window: it can never be sent under it.
    Never { limit: Uuid, reserved: i64 },
}

#[derive(FromRow)]
struct Answer {
    r_limit: Uuid,
    r_bucket: Option<i64>,
    r_tokens: i64,
    r_requests: i64,
    r_ratio: f64,
    r_units: i64,
    r_expires_ms: i64,
    r_reopens_at: Option<DateTime<Utc>>,
    r_never: bool,
    r_settling: bool,
}

/// Grants room for at least one call of `tenant`'s of `estimate` tokens and at most `want`, in
/// every limit of `limits` or in none (`agentq_rate_reserve`, one statement). While other
/// tenants have calls waiting on a limit, the tenants take turns there: one call each, and
/// another tenant's call only where the window holds room for the turn's too.
pub async fn reserve(
    pool: &PgPool,
    tenant: &str,
    limits: &[Uuid],
    estimate: i64,
    want: i32,
) -> Result<Reservation> {
    let rows: Vec<Answer> = sqlx::query_as("SELECT * FROM agentq_rate_reserve($1, $2, $3, $4)")
        .bind(limits)
        .bind(estimate)
        .bind(want)
        .bind(tenant)
        .fetch_all(pool)
        .await?;
    if let Some(never) = rows.iter().find(|r| r.r_never) {
        return Ok(Reservation::Never {
            limit: never.r_limit,
            reserved: never.r_tokens,
        });
    }
    let refused: Vec<&Answer> = rows.iter().filter(|r| r.r_reopens_at.is_some()).collect();
    if let Some(latest) = refused.iter().max_by_key(|r| r.r_reopens_at) {
        return Ok(Reservation::Refused {
            limit: latest.r_limit,
            reopens_at: latest.r_reopens_at.expect("filtered on it"),
            settling: refused.iter().all(|r| r.r_settling),
        });
    }
    let first = rows.first();
    Ok(Reservation::Granted(Grant {
        units: first.map_or(0, |r| r.r_units),
        expires_in: std::time::Duration::from_millis(
            first.map_or(0, |r| r.r_expires_ms).max(0) as u64
        ),
        held: rows
            .iter()
            .filter_map(|r| {
                Some(Held {
                    limit: r.r_limit,
                    bucket: r.r_bucket?,
                    tokens: r.r_tokens,
                    requests: r.r_requests,
                    ratio: r.r_ratio,
                })
            })
            .collect(),
    }))
}

/// One limit's bucket settled by [`settle`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settlement {
    pub limit: Uuid,
    pub bucket: i64,
    /// Tokens to add (negative: returned).
    pub tokens: i64,
    /// Calls to add (negative: returned).
    pub requests: i64,
    /// Grants in flight to add: -1 when a grant is settled.
    pub pending: i64,
    /// The largest ratio of a call's reported usage to its estimate (0 when none was above 1).
    pub ratio: f64,
}

/// Applies settlements in one statement (`agentq_rate_settle`).
pub async fn settle(pool: &PgPool, settled: &[Settlement]) -> Result<()> {
    let col = |f: fn(&Settlement) -> i64| settled.iter().map(f).collect::<Vec<i64>>();
    sqlx::query("SELECT agentq_rate_settle($1, $2, $3, $4, $5, $6)")
        .bind(settled.iter().map(|s| s.limit).collect::<Vec<Uuid>>())
        .bind(col(|s| s.bucket))
        .bind(col(|s| s.tokens))
        .bind(col(|s| s.requests))
        .bind(col(|s| s.pending))
        .bind(settled.iter().map(|s| s.ratio).collect::<Vec<f64>>())
        .execute(pool)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(scope: Scope, name: &str, tenant: &str) -> Target {
        Target {
            id: Uuid::nil(),
            scope,
            name: name.into(),
            tenant: tenant.into(),
        }
    }

    #[test]
    fn a_limit_covers_the_calls_it_names_and_no_others() {
        let host = target(Scope::Model, "api.openai.com", "");
        assert!(host.covers("t1", None, "api.openai.com", "gpt-4o"));
        assert!(!host.covers("t1", None, "local", "gpt-4o"));
        let model = target(Scope::Model, "gpt-4o", "");
        assert!(model.covers("t1", None, "api.openai.com", "gpt-4o"));
        assert!(!model.covers("t1", None, "api.openai.com", "gpt-4o-mini"));
        let both = target(Scope::Model, "api.openai.com/gpt-4o", "");
        assert!(both.covers("t1", None, "api.openai.com", "gpt-4o"));
        assert!(!both.covers("t1", None, "api.openai.com", "gpt-4o-mini"));
        assert!(!both.covers("t1", None, "other.example", "gpt-4o"));
        let tenant = target(Scope::Tenant, "t1", "");
        assert!(tenant.covers("t1", Some("k"), "local", "m"));
        assert!(!tenant.covers("t2", None, "local", "m"));
        let key = target(Scope::Key, "org-1", "t1");
        assert!(key.covers("t1", Some("org-1"), "local", "m"));
        assert!(
            !key.covers("t2", Some("org-1"), "local", "m"),
            "another tenant's key"
        );
        assert!(!key.covers("t1", None, "local", "m"));
    }

    #[test]
    fn waiting_for_names_the_limit_and_reads_back() {
        let key = target(Scope::Key, "org-1", "t1");
        let at = DateTime::parse_from_rfc3339("2026-12-03T08:15:30.250Z")
            .unwrap()
            .with_timezone(&Utc);
        let w = waiting_for(&key, at);
        assert_eq!(
            w,
            "(rate limit 00000000-0000-0000-0000-000000000000 key t1:org-1 \
             2026-12-03T08:15:30.250Z)"
        );
        assert_eq!(
            parse_waiting_for(&w),
            Some(("key".into(), "t1:org-1".into(), at))
        );
        assert_eq!(parked_on(&w), Some(Uuid::nil()));
        assert_eq!(parse_waiting_for("(budget)"), None);
        // Labels with a space or a colon read back whole (a tenant `a:b`'s key `c`).
        let odd = target(Scope::Key, "c d", "a:b");
        assert_eq!(
            parse_waiting_for(&waiting_for(&odd, at)),
            Some(("key".into(), "a:b:c d".into(), at))
        );
    }
}
