-- An outbox row is written once and deleted once it is published: nothing looks a row
-- up by its event id (consumers dedupe by it, on their side), so the unique index on
-- it was an index entry written with every row for no reader.
ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_event_id_key;
