-- Drift: a registered service whose live manifest (`GET {url}/agentq/manifest`) no longer
-- matches the one registered (a deploy not registered again). Checked every minute by the
-- scheduler and by `agentq services check`; `drift` lists the differences (NULL: none found),
-- `checked_at` is when the manifest was last fetched and compared. Writing them does not touch
-- `updated_at`, which every role's snapshot of the table is keyed on. A registration clears both.
ALTER TABLE services ADD COLUMN drift text, ADD COLUMN checked_at timestamptz;
