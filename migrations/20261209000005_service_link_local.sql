-- A service's URL (and the addresses its name resolves to) may be link-local or a cloud
-- metadata address (169.254.169.254, fd00:ec2::254, 100.100.100.200) only when the admin who
-- registered it said so (`agentq services add --allow-link-local`): registration and every
-- worker call refuse such an address otherwise, so a mistyped URL cannot reach a cloud's
-- credentials.
ALTER TABLE services ADD COLUMN allow_link_local boolean NOT NULL DEFAULT false;
