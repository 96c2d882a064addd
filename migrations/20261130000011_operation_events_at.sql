-- The console's overview reads the last hour of status events by `at`. Events are appended in
-- time order, so a BRIN index (a few pages, next to free on insert) narrows that read to the
-- newest blocks: measured 2.3 ms instead of 205 ms (a parallel sequential scan) on 1.7 million
-- events.
CREATE INDEX operation_events_at ON operation_events USING brin (at);
