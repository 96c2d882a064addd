-- Stores: the directories and tables a tenant's operations may read or write, registered by an
-- admin (`agentq stores add`, audited in operator_actions). A kind names a store; it never takes
-- a path or a table name from an operation's input.
CREATE TABLE stores (
    tenant_id   text        NOT NULL,
    name        text        NOT NULL,
    -- 'dir': location is an absolute directory; 'table': location is [schema.]table.
    kind        text        NOT NULL CHECK (kind IN ('dir', 'table')),
    location    text        NOT NULL,
    id_column   text,
    body_column text,
    -- What operations may do with it: read (a source), write (a target), or both.
    access      text        NOT NULL CHECK (access IN ('read', 'write', 'read_write')),
    created_by  text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, name)
);
