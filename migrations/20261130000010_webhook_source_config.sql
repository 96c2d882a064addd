-- Per-source configuration of a webhook source (e.g. the `triage` kind's callback URL and
-- labels). NULL: a delivery's JSON body is the operation's input as is; set: the input is
-- {"event": body, "source", "webhook_id", "config"}.
ALTER TABLE webhook_sources ADD COLUMN config jsonb;
