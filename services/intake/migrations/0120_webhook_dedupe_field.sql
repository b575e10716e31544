-- A webhook source may deduplicate its deliveries by a business id in the body
-- (a JSON pointer such as /ticket/id) rather than by the sender's event id.
ALTER TABLE webhook_sources ADD COLUMN dedupe_field TEXT;
