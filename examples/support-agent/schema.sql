-- The support agent's own table: orders, per tenant, in the shop's own database
-- (`SUPPORT_DATABASE_URL`; for a demo on one server, agentq's `DATABASE_URL` by default).
CREATE TABLE IF NOT EXISTS support_orders (
    tenant      text   NOT NULL,
    order_id    text   NOT NULL,
    customer    text   NOT NULL,
    total_cents bigint NOT NULL CHECK (total_cents >= 0),
    status      text   NOT NULL,
    PRIMARY KEY (tenant, order_id)
);
