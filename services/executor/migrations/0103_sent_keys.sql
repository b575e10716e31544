-- The operation key a generation's call of a step last sent (its call intent). A
-- person's `retry_as_new` follows it to the key actually in doubt: a generation
-- that re-sent an earlier generation's key, or followed it, sent no key of its
-- own, and its `seq` alone would name a key that never left. Rows written before
-- this column existed are taken to have sent the key their `seq` makes.
ALTER TABLE call_sequences ADD COLUMN sent_key text;
UPDATE call_sequences SET sent_key = encode(sha256(convert_to(
    task_id::text || ':' || step || ':' || generation::text || ':' || seq::text, 'UTF8')), 'hex');
