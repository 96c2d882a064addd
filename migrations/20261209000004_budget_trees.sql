-- Budgets cover a tree: a child's model calls count against every budget over its ancestors
-- (a schedule's, a webhook source's or an operator's budget on its root or on any parent
-- between) and over its tree's batch. A spawn copied no budget and no batch, so a parent under
-- a 150-token budget spawned a child that spent 1,000 tokens.
--
-- `ancestors`: the ids of the operation's ancestors, its root first, its parent last; set by
-- the spawn (a root's is empty). `tree_batch_id`: the batch of its root, for a child (a root's
-- own batch is `batch_id`; a child is no document of it: its counts and completion do not
-- count children). AGENTQ_MAX_SPAWN_DEPTH bounds the array.
ALTER TABLE operations
    ADD COLUMN ancestors     uuid[] NOT NULL DEFAULT '{}',
    ADD COLUMN tree_batch_id uuid;

-- Children that exist already: their ancestors and their tree's batch.
WITH RECURSIVE tree(id, ancestors, batch) AS (
    SELECT r.id, '{}'::uuid[], r.batch_id FROM operations r
     WHERE r.parent_id IS NULL
       AND EXISTS (SELECT 1 FROM operations c WHERE c.parent_id = r.id)
    UNION ALL
    SELECT c.id, t.ancestors || t.id, t.batch
      FROM operations c JOIN tree t ON c.parent_id = t.id
)
UPDATE operations o SET ancestors = t.ancestors, tree_batch_id = t.batch
  FROM tree t
 WHERE o.id = t.id AND o.parent_id IS NOT NULL;

-- A raise of a batch's budget queues again the children of its documents that wait for it.
CREATE INDEX operations_tree_batch ON operations (tree_batch_id) WHERE tree_batch_id IS NOT NULL;
