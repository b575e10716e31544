-- One idempotency namespace per source: a key is unique within (tenant, namespace),
-- where the namespace is the task's source (`api`, `webhook:{source}`,
-- `topic:{source}`). An API client's key can then never replay, or be refused
-- against, a webhook's or an upstream record's task that happens to spell the same.
--
-- Existing keys move into the namespace of the task they created, so every stored
-- key keeps replaying as before (the key texts themselves are unchanged).
ALTER TABLE idempotency_keys ADD COLUMN namespace text;
UPDATE idempotency_keys k SET namespace = t.source FROM tasks t WHERE t.task_id = k.task_id;
UPDATE idempotency_keys SET namespace = 'api' WHERE namespace IS NULL;
ALTER TABLE idempotency_keys ALTER COLUMN namespace SET NOT NULL;
ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey;
ALTER TABLE idempotency_keys ADD PRIMARY KEY (tenant, namespace, idempotency_key);
