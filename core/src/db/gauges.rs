//! SQL of the database gauges `/metrics` reads at scrape time (see `crate::metrics`): queue
//! depth and oldest age by lane, open dead letters by class. Each is one aggregate over a
//! partial index, cheap enough to run on every scrape.

use sqlx::{FromRow, PgPool};

use super::Result;

/// Due queued operations of one lane.
#[derive(Clone, Debug, FromRow)]
pub struct LaneQueue {
    pub lane: String,
    /// Queued operations whose `run_at` has come (a future retry is not waiting yet).
    pub depth: i64,
    /// Seconds since the `run_at` of the oldest of them.
    pub oldest_age_secs: f64,
}

/// Count and oldest age of the queued, due operations per lane (lanes with none are absent).
pub async fn queues_by_lane(pool: &PgPool) -> Result<Vec<LaneQueue>> {
    let rows = sqlx::query_as(
        "SELECT lane, count(*) AS depth,
                COALESCE(EXTRACT(EPOCH FROM now() - min(run_at)), 0)::float8 AS oldest_age_secs
           FROM operations
          WHERE status = 'queued' AND run_at <= now()
          GROUP BY lane",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// Open dead letters per failure class.
pub async fn open_dead_letters_by_class(pool: &PgPool) -> Result<Vec<(String, i64)>> {
    let rows = sqlx::query_as(
        "SELECT class, count(*) FROM dead_letters WHERE status = 'open' GROUP BY class",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows)
}
