-- Operator pauses: an operation, or every operation of a kind, a tenant, a lane or a schedule
-- (any combination of them: each column that is set must match), or the whole deployment (no
-- column set: drain mode). A paused operation is not claimed; a running one stops at its next
-- step boundary and goes back to the queue with its journal, its attempt given back. Resuming
-- deletes the row and re-dispatches what it held.
CREATE TABLE pauses (
    id          uuid        PRIMARY KEY,
    tenant_id   text,
    kind        text,
    lane        text        CHECK (lane IN ('interactive', 'batch')),
    schedule_id uuid,
    op_id       uuid,
    reason      text        NOT NULL CHECK (reason <> ''),
    paused_by   text        NOT NULL,
    paused_at   timestamptz NOT NULL DEFAULT now()
);
-- One pause per scope: pausing what is already paused finds the existing pause.
CREATE UNIQUE INDEX pauses_scope ON pauses (
    COALESCE(tenant_id, ''), COALESCE(kind, ''), COALESCE(lane, ''),
    COALESCE(schedule_id::text, ''), COALESCE(op_id::text, ''));

-- The pause that held an operation when the pause was made (its row was marked under its row
-- lock, so a claim racing the pause either committed first, and the heartbeat stops the run, or
-- sees the mark). Operations born later are held by the claim's `agentq_paused` test.
ALTER TABLE operations ADD COLUMN paused_by uuid;
CREATE INDEX operations_paused ON operations (paused_by) WHERE paused_by IS NOT NULL;

-- True when the pause `p` holds an operation of this tenant, kind, lane, schedule and id.
CREATE FUNCTION agentq_pause_holds(p pauses, p_tenant text, p_kind text, p_lane text,
                                   p_schedule uuid, p_op uuid)
RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
    SELECT (p.tenant_id IS NULL OR p.tenant_id = p_tenant)
       AND (p.kind IS NULL OR p.kind = p_kind)
       AND (p.lane IS NULL OR p.lane = p_lane)
       AND (p.schedule_id IS NULL OR p.schedule_id = p_schedule)
       AND (p.op_id IS NULL OR p.op_id = p_op)
$$;

-- True when any pause holds such an operation: the claim, the lease renewal and the dispatch
-- sweeps ask this of operations born after a pause was made.
CREATE FUNCTION agentq_paused(p_tenant text, p_kind text, p_lane text, p_schedule uuid, p_op uuid)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM pauses p
                    WHERE agentq_pause_holds(p, p_tenant, p_kind, p_lane, p_schedule, p_op))
$$;
