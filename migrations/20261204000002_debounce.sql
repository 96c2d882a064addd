-- Debounce on a key (issue 29): deliveries or enqueues naming the same (tenant, debounce key)
-- within a window fold into one pending operation (last input wins), started once the window
-- has passed with no new arrival, and never later than first arrival + max_delay.
--
-- `debounce_until` (first arrival + max_delay) is set only while the operation is pending: it
-- is queued and has never been claimed. Leaving `queued` clears it (the trigger below), so an
-- operation that ran once never takes new input, whatever brings it back to `queued` later.
ALTER TABLE operations
    ADD COLUMN debounce_key   text,
    ADD COLUMN debounce_until timestamptz;

-- At most one pending operation per key: the one statement of a debounced enqueue inserts it
-- or, on conflict with this index, replaces its input and pushes its run_at back.
CREATE UNIQUE INDEX operations_debounce_pending ON operations (tenant_id, debounce_key)
    WHERE status = 'queued' AND debounce_until IS NOT NULL;
-- The key's started, unfinished operations (the conflict policy's `skip` and `cancel_running`).
CREATE INDEX operations_debounce_key ON operations (tenant_id, debounce_key)
    WHERE debounce_key IS NOT NULL AND status IN ('queued', 'running', 'sleeping', 'waiting');

CREATE FUNCTION agentq_debounce_close() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.debounce_until := NULL;
    RETURN NEW;
END $$;
CREATE TRIGGER operations_debounce_close BEFORE UPDATE OF status ON operations
    FOR EACH ROW WHEN (OLD.debounce_until IS NOT NULL AND NEW.status <> 'queued')
    EXECUTE FUNCTION agentq_debounce_close();

-- Every delivery or enqueue folded into a debounced operation, by its dedupe key (a webhook's
-- `webhook:<source>:<id>`, an Idempotency-Key): a re-sent one finds the operation it joined.
CREATE TABLE debounced_deliveries (
    tenant_id    text        NOT NULL,
    dedupe_key   text        NOT NULL,
    op_id        uuid        NOT NULL REFERENCES operations ON DELETE CASCADE,
    input_sha256 text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, dedupe_key)
);
CREATE INDEX debounced_deliveries_op ON debounced_deliveries (op_id);

-- A webhook source's debounce: {"pointer", "window_ms", "max_delay_ms", "on_running"}; the key
-- is read from each delivery's body at the JSON pointer.
ALTER TABLE webhook_sources ADD COLUMN debounce jsonb;
