//! SQL of child operations: `ctx.spawn` inserts a child once per spawn step, `ctx.join`
//! decides a join in one fenced statement, and the console reads an operation's tree.
//!
//! Waking a parent whose joined children have all finished is the scheduler's wake sweep
//! ([`super::timers::wake_due`]); cancelling a parent cancels its unfinished children (a
//! trigger, whatever cancelled it).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::{Result, dispatch::Dispatch};
use crate::state::Status;

/// What [`spawn`] did.
#[derive(Clone, Debug, PartialEq)]
pub enum Spawned {
    /// A new child, to dispatch.
    Created(Dispatch),
    /// The spawn step ran before (its journal row was lost in a crash): the child it made.
    Existing(Uuid),
    /// The parent does not exist (any more).
    NoParent,
    /// The parent has spawned as many children as one operation may (the cap given).
    Capped(i64),
    /// An admin's list keeps the child's kind from the parent's tenant (migration 20).
    KindNotAllowed,
    /// The parent is already this many spawns below its root, the most a tree may be.
    TooDeep(i64),
}

/// Inserts the child of `parent` that the spawn step with dedupe key `key` makes, or finds
/// the one it made before. The child takes its parent's tenant, lane, attempt budget, trace and
/// rate key, and its place in the tree: its ancestors (the parent's and the parent) and its
/// tree's batch, so every budget over them covers it too. A parent that has spawned
/// `max_children` makes no more (`children_spawned`, counted in the same statement, with the
/// parent's row locked), none `max_depth` spawns below a root, and none of a kind its tenant
/// may not use.
#[allow(clippy::too_many_arguments)]
pub async fn spawn(
    pool: &PgPool,
    parent: Uuid,
    key: &str,
    kind: &str,
    input: &Value,
    input_sha256: &str,
    max_children: i64,
    max_depth: i64,
) -> Result<Spawned> {
    let created: Option<Dispatch> = sqlx::query_as(
        "WITH p AS (
            SELECT id, tenant_id, lane, max_attempts, traceparent, children_spawned, rate_key,
                   ancestors, COALESCE(batch_id, tree_batch_id) AS tree_batch_id
              FROM operations WHERE id = $6
               FOR NO KEY UPDATE
         ), child AS (
            INSERT INTO operations (id, tenant_id, kind, lane, input, input_sha256, dedupe_key,
                                    max_attempts, traceparent, parent_id, rate_key, ancestors,
                                    tree_batch_id)
            SELECT $1, p.tenant_id, $2, p.lane, $3, $4, $5, p.max_attempts, p.traceparent, p.id,
                   p.rate_key, p.ancestors || p.id, p.tree_batch_id
              FROM p WHERE p.children_spawned < $7 AND agentq_kind_allowed(p.tenant_id, $2)
                AND cardinality(p.ancestors) < $8
            ON CONFLICT (tenant_id, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
         RETURNING id, tenant_id, kind, lane, epoch, traceparent
         ), counted AS (
            UPDATE operations o SET children_spawned = o.children_spawned + 1
              FROM p WHERE o.id = p.id AND EXISTS (SELECT 1 FROM child)
         )
         SELECT id, tenant_id, kind, lane, epoch, traceparent FROM child",
    )
    .bind(Uuid::new_v4())
    .bind(kind)
    .bind(input)
    .bind(input_sha256)
    .bind(key)
    .bind(parent)
    .bind(max_children)
    .bind(max_depth)
    .fetch_optional(pool)
    .await?;
    if let Some(d) = created {
        return Ok(Spawned::Created(d));
    }
    let existing: Option<Uuid> = sqlx::query_scalar(
        "SELECT c.id FROM operations p
           JOIN operations c ON c.tenant_id = p.tenant_id AND c.dedupe_key = $2
          WHERE p.id = $1 AND c.parent_id = p.id",
    )
    .bind(parent)
    .bind(key)
    .fetch_optional(pool)
    .await?;
    if let Some(id) = existing {
        return Ok(Spawned::Existing(id));
    }
    let spawned: Option<(i32, bool, i32)> = sqlx::query_as(
        "SELECT children_spawned, agentq_kind_allowed(tenant_id, $2), cardinality(ancestors)
           FROM operations WHERE id = $1",
    )
    .bind(parent)
    .bind(kind)
    .fetch_optional(pool)
    .await?;
    Ok(match spawned {
        Some((_, false, _)) => Spawned::KindNotAllowed,
        Some((n, ..)) if i64::from(n) >= max_children => Spawned::Capped(max_children),
        Some((.., depth)) if i64::from(depth) >= max_depth => Spawned::TooDeep(max_depth),
        _ => Spawned::NoParent,
    })
}

/// The answer of [`resolve_join`].
#[derive(Clone, Debug, PartialEq)]
pub enum Join {
    /// Every child finished; the join step's journaled output (one entry per child, in the
    /// order asked).
    Resolved(Value),
    /// Some child is unfinished: the parent may park (the wake sweep queues it when they are).
    Pending,
    /// These ids are not children of the operation.
    NotChildren(Vec<Uuid>),
    /// This worker no longer holds the operation.
    LeaseLost,
}

/// Decides the join step `seq` of `id` over `children`, once: if every child has finished,
/// the step completes with how each ended; otherwise the children are recorded in `joining`,
/// and how many are unfinished in `join_pending`, for the wake sweep. Fenced by the epoch.
///
/// Two statements in one transaction: the first locks the parent, the second counts its
/// children with a snapshot taken after that lock and deletes the parent's `join_deltas`
/// with the same snapshot. A child finishing takes its parent's lock only if it is free
/// (migration `join_deltas`): if it got it, it committed before this transaction locked the
/// parent and the count sees it finished; if not, it appended a delta, which the count either
/// sees with its end (and deletes) or does not see, like its end (and the wake sweep adds it).
/// None is missed or counted twice, and a child's end never waits for the parent.
pub async fn resolve_join(
    pool: &PgPool,
    id: Uuid,
    epoch: i64,
    seq: i32,
    children: &[Uuid],
) -> Result<Join> {
    let mut tx = pool.begin().await?;
    let locked: Option<Uuid> = sqlx::query_scalar(
        "SELECT id FROM operations WHERE id = $1 AND epoch = $2 AND status = 'running'
            FOR NO KEY UPDATE",
    )
    .bind(id)
    .bind(epoch)
    .fetch_optional(&mut *tx)
    .await?;
    if locked.is_none() {
        tx.rollback().await?;
        return Ok(Join::LeaseLost);
    }
    let (held, output, found): (bool, Option<Value>, Vec<Uuid>) = sqlx::query_as(concat!(
        "WITH lease AS (
            SELECT id FROM operations WHERE id = $1 AND epoch = $2 AND status = 'running'
               FOR NO KEY UPDATE
         ), kids AS (
            SELECT c.id, c.status, c.kind, c.result, c.error_class, c.error_message
              FROM operations c, lease
             WHERE c.id = ANY($4) AND c.parent_id = lease.id
         ), cleared AS (
            -- What this snapshot counts: the ends it sees are in `kids` already.
            DELETE FROM join_deltas d USING lease WHERE d.parent_id = lease.id
         ), decided AS (
            SELECT CASE WHEN (SELECT count(*) FROM kids) = cardinality($4)
                         AND NOT EXISTS (SELECT 1 FROM kids WHERE status NOT IN ",
        crate::state::terminal_sql!(),
        ")
                   THEN (SELECT jsonb_agg(jsonb_strip_nulls(jsonb_build_object(
                                    'op_id', k.id, 'kind', k.kind, 'status', k.status,
                                    'result', k.result, 'error_class', k.error_class,
                                    'error_message', k.error_message))
                                  ORDER BY array_position($4, k.id))
                           FROM kids k)
                   END AS output
         ), ",
        super::timers::park_decided_cte!(),
        ", mark AS (
            UPDATE operations o
               SET joining = $4,
                   join_pending = (SELECT count(*) FROM kids WHERE status NOT IN ",
        crate::state::terminal_sql!(),
        ")
              FROM lease
             WHERE o.id = lease.id AND NOT EXISTS (SELECT 1 FROM step)
         RETURNING o.id
         )
         -- (`mark` and `cleared` run whether read or not, like every data-modifying CTE.)
         SELECT EXISTS (SELECT 1 FROM lease), (SELECT output FROM step), ARRAY(SELECT id FROM kids)"
    ))
    .bind(id)
    .bind(epoch)
    .bind(seq)
    .bind(children)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    if !held {
        return Ok(Join::LeaseLost);
    }
    if let Some(output) = output {
        return Ok(Join::Resolved(output));
    }
    let strangers: Vec<Uuid> = children
        .iter()
        .filter(|c| !found.contains(c))
        .copied()
        .collect();
    if strangers.is_empty() {
        Ok(Join::Pending)
    } else {
        Ok(Join::NotChildren(strangers))
    }
}

/// One operation of a tree, for the console.
#[derive(Clone, Debug, FromRow)]
pub struct Node {
    pub id: Uuid,
    /// 1 for a child, 2 for a grandchild…
    pub depth: i32,
    pub parent_id: Uuid,
    pub kind: String,
    pub status: Status,
    pub error_class: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// The descendants of `root` (at most `limit`, depth first in creation order) and whether
/// there were more.
pub async fn descendants(pool: &PgPool, root: Uuid, limit: i64) -> Result<(Vec<Node>, bool)> {
    let mut rows: Vec<Node> = sqlx::query_as(
        "WITH RECURSIVE tree AS (
            SELECT c.id, 1 AS depth, c.parent_id, c.kind, c.status, c.error_class, c.created_at,
                   ARRAY[c.created_at::text || c.id::text] AS path
              FROM operations c WHERE c.parent_id = $1
            UNION ALL
            SELECT c.id, t.depth + 1, c.parent_id, c.kind, c.status, c.error_class, c.created_at,
                   t.path || (c.created_at::text || c.id::text)
              FROM operations c JOIN tree t ON c.parent_id = t.id
             WHERE t.depth < 20
         )
         SELECT id, depth, parent_id, kind, status, error_class, created_at
           FROM tree ORDER BY path LIMIT $2",
    )
    .bind(root)
    .bind(limit + 1)
    .fetch_all(pool)
    .await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    Ok((rows, more))
}
