-- When a look-up's "never received" may be believed for a case: once every request
-- the lost worker could still have sent has arrived at the provider or failed (the
-- call timeout and the provider's registration time after the loss was reported).
-- 0 for cases opened before this column existed: believed at once, as they were.
ALTER TABLE cases ADD COLUMN never_received_counts_from_us bigint NOT NULL DEFAULT 0;
