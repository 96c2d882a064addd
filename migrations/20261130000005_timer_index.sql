-- The timer loop's own index: only sleeping and waiting operations, so a large backlog of
-- queued operations never lengthens a timer poll.
CREATE INDEX operations_timers ON operations (run_at) WHERE status IN ('sleeping', 'waiting');
