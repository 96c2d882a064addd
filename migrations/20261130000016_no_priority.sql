-- `priority` was stored and never read: lanes were always what decides what runs first (each
-- lane has its own queue and its own slots on every worker, so interactive work never waits
-- behind a batch backlog). A field that does nothing is dropped rather than kept as a promise.
ALTER TABLE operations DROP COLUMN priority;
ALTER TABLE schedules DROP COLUMN priority;
