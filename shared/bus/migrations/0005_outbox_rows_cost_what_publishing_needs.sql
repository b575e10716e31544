-- An outbox row is written once and deleted once it is published: nothing looks a row
-- up by its event id (consumers dedupe by it, on their side), so the unique index on
-- it was an index entry written with every row for no reader.
-- No release ever read it (releases insert with fresh ids and never look one up), so
-- the previous release runs beside this one without it.
-- contract: b4da8429a50e9a671fda1942c21657ff19e1d2ca
ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_event_id_key;
