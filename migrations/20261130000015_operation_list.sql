-- Keyset pages of operations, newest first by (created_at, id): `GET /v1/operations`,
-- `agentq list` and the console's list. A tenant's pages (every non-admin caller) walk the
-- first index backwards; an admin's pages over all tenants the second. Measured on 100,000
-- operations: a page cost 50-110 ms (a sequential scan and a sort, growing with the table)
-- and costs under 1 ms with these.
CREATE INDEX operations_list_by_tenant ON operations (tenant_id, created_at, id);
CREATE INDEX operations_list ON operations (created_at, id);
