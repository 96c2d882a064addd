-- Durable sleeps and human-in-the-loop waits.

-- The signal name a `waiting` operation waits for (NULL otherwise): a signal for that name wakes it.
ALTER TABLE operations ADD COLUMN waiting_for text;

-- Signals not yet consumed by a wait (the scheduler's catch-up sweep joins on these).
CREATE INDEX signals_pending ON signals (op_id, name) WHERE consumed_at IS NULL;

-- Deadlines of operations that no worker holds (a running one is stopped by its worker).
CREATE INDEX operations_deadline ON operations (deadline)
    WHERE deadline IS NOT NULL AND status IN ('queued', 'sleeping', 'waiting');

-- Retention: finished operations by age.
CREATE INDEX operations_finished ON operations (finished_at)
    WHERE status IN ('succeeded', 'cancelled', 'discarded', 'dead');
