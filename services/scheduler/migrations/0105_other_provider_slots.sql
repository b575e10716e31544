-- An attempt holds a slot at every provider it calls before its next approval
-- (docs/execution.md, "Slots"). `slots` keeps, as before, the one row of the
-- grant's own provider, which the previous release also reads and writes; this
-- table holds the grant's slots at the other providers it calls, one row per grant
-- and provider, inserted with its `slots` row and expiring with it. A provider's
-- slots in use are its rows in both tables; a row here counts only while its
-- grant's `slots` row exists, so a release or an expiry by a scheduler that knows
-- only `slots` frees these too (docs/deploy.md, "Rolling upgrades").
CREATE TABLE other_provider_slots (
    grant_id uuid NOT NULL,
    task_id uuid NOT NULL,
    provider text NOT NULL,
    expires_at_us bigint NOT NULL,
    PRIMARY KEY (grant_id, provider)
);
CREATE INDEX other_provider_slots_by_provider ON other_provider_slots (provider, expires_at_us);
-- The retention's question (docs/decisions.md, entry 13).
CREATE INDEX other_provider_slots_by_task ON other_provider_slots (task_id);
