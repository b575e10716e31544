-- The event streams follow `task_changes` by the transaction that wrote each row
-- (docs/dashboard.md, "Where changes come from"): every mark stores its top-level
-- transaction id, and each intake instance reads, every 100 ms, the rows whose
-- writer its previous read's snapshot could not yet see. No notification is sent
-- at commit any more, so commits no longer queue on Postgres' one notification lock.
ALTER TABLE task_changes ADD COLUMN changed_by xid8 NOT NULL DEFAULT pg_current_xact_id();
CREATE INDEX task_changes_by_transaction ON task_changes (changed_by);
