-- Ordering keys: when an operation with an ordering key ends, the next queued operation for the
-- same (tenant, key) must be dispatched again, because its pointer was consumed (and dropped)
-- while its predecessor was active. Clearing `dispatched_at` hands it to the dispatch sweeper;
-- bumping `epoch` voids any late dispatch mark stamped before this moment.
CREATE FUNCTION agentq_release_successor() RETURNS trigger AS $$
BEGIN
    UPDATE operations
       SET dispatched_at = NULL, epoch = epoch + 1
     WHERE id = (SELECT id FROM operations
                  WHERE tenant_id = NEW.tenant_id
                    AND ordering_key = NEW.ordering_key
                    AND status = 'queued'
                    AND id <> NEW.id
                  ORDER BY created_at, id
                  LIMIT 1);
    RETURN NULL;
END
$$ LANGUAGE plpgsql;

CREATE TRIGGER operations_release_successor
    AFTER UPDATE OF status ON operations
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NOT NULL
          AND NEW.status IN ('succeeded', 'dead', 'cancelled', 'discarded')
          AND OLD.status NOT IN ('succeeded', 'dead', 'cancelled', 'discarded'))
    EXECUTE FUNCTION agentq_release_successor();

-- The `ledger` tool of the built-in `script` kind: a stand-in for an outside system with side
-- effects (send an email, charge a card). A safe effect is idempotent on its key; an unsafe one
-- inserts a row every time it runs, so tests can count repeats.
CREATE TABLE ledger_effects (
    id              bigserial   PRIMARY KEY,
    op_id           uuid        NOT NULL,
    label           text        NOT NULL,
    idempotency_key text        NOT NULL,
    replay          text        NOT NULL CHECK (replay IN ('safe', 'unsafe')),
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX ledger_effects_safe_once ON ledger_effects (idempotency_key)
    WHERE replay = 'safe';
CREATE INDEX ledger_effects_key ON ledger_effects (idempotency_key);
