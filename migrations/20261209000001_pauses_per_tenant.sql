-- A pause test reads only the pauses that can hold the operation asked about: its own tenant's
-- and the deployment-wide ones (an admin's, no tenant). `agentq_paused` runs per row in the
-- claim, the lease renewal and the dispatch sweeps; it scanned every pause, so one tenant's
-- pauses (any number of them, for made-up kinds) slowed every other tenant's leases past the
-- database's timeout. Now each tenant's pauses are capped (AGENTQ_TENANT_MAX_PAUSES, checked
-- where a pause is made), name only kinds the deployment serves, and are found through this
-- index: another tenant's pauses are never read.
CREATE INDEX pauses_tenant ON pauses (tenant_id, kind);

CREATE OR REPLACE FUNCTION agentq_paused(p_tenant text, p_kind text, p_lane text, p_schedule uuid,
                                         p_op uuid)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM pauses p
                    WHERE p.tenant_id = p_tenant
                      AND agentq_pause_holds(p, p_tenant, p_kind, p_lane, p_schedule, p_op))
        OR EXISTS (SELECT 1 FROM pauses p
                    WHERE p.tenant_id IS NULL
                      AND agentq_pause_holds(p, p_tenant, p_kind, p_lane, p_schedule, p_op))
$$;
