//! SQL of retention: deleting finished operations (with their journals and signals) once they
//! are old enough.

use sqlx::PgPool;

use super::Result;
use crate::state::terminal_sql;

/// Deletes up to `limit` finished operations (with their journals and signals) that finished
/// more than `days` ago; a dead one still waiting for a human (open dead letter) is kept, and
/// so is a child whose parent is unfinished. Their dedupe keys become reusable. Also deletes up
/// to `limit` of the `join_deltas` of parents that have finished.
pub async fn delete_expired(pool: &PgPool, days: u32, limit: i64) -> Result<u64> {
    let n = sqlx::query(concat!(
        "DELETE FROM operations WHERE id IN (
            SELECT o.id FROM operations o
             WHERE o.status IN ",
        terminal_sql!(),
        "
               AND o.finished_at < now() - make_interval(days => $1)
               AND NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.op_id = o.id AND d.status = 'open')
               -- A child stays while its parent is unfinished: the parent's join reads it.
               AND NOT EXISTS (SELECT 1 FROM operations p
                                WHERE p.id = o.parent_id AND p.status NOT IN ",
        terminal_sql!(),
        ")
             ORDER BY o.finished_at
             LIMIT $2
               FOR UPDATE SKIP LOCKED)"
    ))
    .bind(days as i32)
    .bind(limit)
    .execute(pool)
    .await?
    .rows_affected();
    // The count changes of children whose parent has finished (or is gone): no join reads them.
    sqlx::query(concat!(
        "DELETE FROM join_deltas WHERE ctid IN (
            SELECT d.ctid FROM join_deltas d
             WHERE NOT EXISTS (SELECT 1 FROM operations p
                                WHERE p.id = d.parent_id AND p.status NOT IN ",
        terminal_sql!(),
        ")
             LIMIT $1)"
    ))
    .bind(limit)
    .execute(pool)
    .await?;
    Ok(n)
}
