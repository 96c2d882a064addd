//! Bulk fixtures for `agentq bench` scenarios: rows written straight into the tables, so a
//! benchmark of the scheduler is not a benchmark of the enqueue path, and the reads the
//! reports are made of. The benchmarks' own SQL, kept out of the engine's `core::db`.

use agentq_core::Status;
use chrono::{DateTime, Utc};
use sqlx::PgPool;

type Result<T> = sqlx::Result<T>;

/// Inserts `n` sleeping operations, the i-th due at `first_due + i × spacing_ms`.
pub async fn insert_sleepers(
    pool: &PgPool,
    n: i64,
    first_due: DateTime<Utc>,
    spacing_ms: f64,
) -> Result<u64> {
    let rows = sqlx::query(
        "INSERT INTO operations (id, tenant_id, kind, input, input_sha256, status, attempt, epoch, run_at)
         SELECT gen_random_uuid(), 'bench', 'echo', '{\"text\":\"zz\"}', 'bench', 'sleeping', 1, 1,
                $2 + make_interval(secs => g * $3 / 1000.0)
           FROM generate_series(0, $1 - 1) g",
    )
    .bind(n)
    .bind(first_due)
    .bind(spacing_ms)
    .execute(pool)
    .await?
    .rows_affected();
    sqlx::query("ANALYZE operations").execute(pool).await?;
    Ok(rows)
}

/// Inserts `parents` operations of tenant `noisy` parked on a join over `children` children
/// each, all finished but one (sleeping, not due): the case the join's re-scan was worst at,
/// every pass walking finished children until it met the unfinished one. Counted as
/// `ctx.join` counts them (one unfinished child each).
pub async fn insert_join_parents(pool: &PgPool, parents: i64, children: i64) -> Result<u64> {
    let mut tx = pool.begin().await?;
    let inserted = sqlx::query(
        "WITH parents AS (
            INSERT INTO operations (id, tenant_id, kind, input, input_sha256, status, attempt,
                                    epoch, run_at, waiting_for)
            SELECT gen_random_uuid(), 'noisy', 'script', '{\"steps\":[]}', 'bench', 'waiting', 1, 1,
                   now() + interval '100 years', '(children)'
              FROM generate_series(1, $1)
         RETURNING id
         )
         INSERT INTO operations (id, tenant_id, kind, input, input_sha256, status, attempt, epoch,
                                 run_at, parent_id)
         SELECT gen_random_uuid(), 'noisy', 'echo', '{\"text\":\"x\"}', 'bench',
                CASE WHEN g = $2 THEN 'sleeping' ELSE 'succeeded' END, 1, 1,
                now() + interval '30 days', p.id
           FROM parents p, generate_series(1, $2) g",
    )
    .bind(parents)
    .bind(children)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    sqlx::query(
        "UPDATE operations o SET joining = k.ids, join_pending = k.pending
           FROM (SELECT parent_id, array_agg(id) AS ids,
                        count(*) FILTER (WHERE status = 'sleeping')::int AS pending
                   FROM operations
                  WHERE parent_id IS NOT NULL AND tenant_id = 'noisy' GROUP BY parent_id) k
          WHERE o.id = k.parent_id",
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    sqlx::query("ANALYZE operations").execute(pool).await?;
    Ok(inserted)
}

/// Times the wake sweep's read of parents whose joins are done, in ms: as it is now (a count
/// per parked parent) and as it was before migration 18 (every joined child checked on every
/// pass, the statement kept here for this comparison only). Neither wakes anything.
pub async fn time_join_reads(pool: &PgPool) -> Result<(f64, f64)> {
    let count = "SELECT o.id FROM operations o
                  WHERE o.status = 'waiting' AND o.waiting_for = '(children)'
                    AND o.join_pending + COALESCE((SELECT sum(d.delta) FROM join_deltas d
                                                    WHERE d.parent_id = o.id
                                                      AND d.child_id = ANY(o.joining)), 0) <= 0
                  LIMIT 500";
    // The terminal statuses as an SQL list, as `core::state`'s `terminal_sql!` spells them.
    let terminal: Vec<String> = Status::ALL
        .iter()
        .filter(|s| s.is_terminal())
        .map(|s| format!("'{}'", s.as_str()))
        .collect();
    let scan = format!(
        "SELECT o.id FROM operations o
          WHERE o.status = 'waiting' AND o.waiting_for = '(children)'
            AND NOT EXISTS (SELECT 1 FROM operations c
                             WHERE c.id = ANY(o.joining) AND c.status NOT IN ({})) LIMIT 500",
        terminal.join(", ")
    );
    let mut ms = [0.0; 2];
    for (i, sql) in [count, &scan].into_iter().enumerate() {
        let started = std::time::Instant::now();
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(pool).await?;
        ms[i] = started.elapsed().as_secs_f64() * 1000.0;
    }
    Ok((ms[0], ms[1]))
}

/// Woken operations so far, and for each the wake lag in ms (woken − due).
pub async fn wake_lags(pool: &PgPool, since: DateTime<Utc>) -> Result<Vec<f64>> {
    let lags = sqlx::query_scalar(
        "SELECT (extract(epoch FROM updated_at - run_at) * 1000)::float8 FROM operations
          WHERE status = 'queued' AND run_at >= $1",
    )
    .bind(since)
    .fetch_all(pool)
    .await?;
    Ok(lags)
}

/// Operations in `status`.
pub async fn count_status(pool: &PgPool, status: &str) -> Result<i64> {
    let n = sqlx::query_scalar("SELECT count(*) FROM operations WHERE status = $1")
        .bind(status)
        .fetch_one(pool)
        .await?;
    Ok(n)
}

/// How many of `ids` are stored operations (benchmarks check every accepted id was stored).
pub async fn count_existing(pool: &PgPool, ids: &[uuid::Uuid]) -> Result<i64> {
    let n = sqlx::query_scalar("SELECT count(*) FROM operations WHERE id = ANY($1)")
        .bind(ids)
        .fetch_one(pool)
        .await?;
    Ok(n)
}

/// Queued operations whose pointer is not yet marked dispatched.
pub async fn count_unmarked(pool: &PgPool) -> Result<i64> {
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM operations WHERE status = 'queued' AND dispatched_at IS NULL",
    )
    .fetch_one(pool)
    .await?;
    Ok(n)
}

/// Other sessions connected to this database: a benchmark waits for its stopped processes'
/// backends to exit (they flush their statistics then) before reading the commit count.
pub async fn other_sessions(pool: &PgPool) -> Result<i64> {
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_one(pool)
    .await?;
    Ok(n)
}

/// For every operation created since `since`, the ms between one completed step and the next
/// (seq ≥ 1): a step's cost as its job sees it, including the wait for the previous step's
/// commit.
pub async fn step_intervals(pool: &PgPool, since: DateTime<Utc>) -> Result<Vec<f64>> {
    let ms: Vec<Option<f64>> = sqlx::query_scalar(
        "SELECT (extract(epoch FROM s.completed_at - lag(s.completed_at) OVER w) * 1000)::float8
           FROM operation_steps s JOIN operations o ON o.id = s.op_id
          WHERE s.status = 'completed' AND o.created_at >= $1
         WINDOW w AS (PARTITION BY s.op_id ORDER BY s.seq)",
    )
    .bind(since)
    .fetch_all(pool)
    .await?;
    Ok(ms.into_iter().flatten().collect())
}

/// Whether the model step at `seq` of the `agent` operation whose input's `user` is `user` is
/// committed as completed (the bench's crash-cost check, made as a model request arrives).
pub async fn agent_step_completed(pool: &PgPool, user: &str, seq: i32) -> Result<bool> {
    let done = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM operation_steps s JOIN operations o ON o.id = s.op_id
                         WHERE o.kind = 'agent' AND o.input->>'user' = $1 AND s.seq = $2
                           AND s.status = 'completed')",
    )
    .bind(user)
    .bind(seq)
    .fetch_one(pool)
    .await?;
    Ok(done)
}

/// Completed model steps (journaled model calls) of the operations of `kind`.
pub async fn journaled_model_calls(pool: &PgPool, kind: &str) -> Result<i64> {
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM operation_steps s JOIN operations o ON o.id = s.op_id
          WHERE o.kind = $1 AND s.kind = 'model' AND s.status = 'completed'",
    )
    .bind(kind)
    .fetch_one(pool)
    .await?;
    Ok(n)
}
