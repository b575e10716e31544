-- When each step's key was first sent (its first call intent): a provider that
-- remembers keys for a while must not be sent one it may have forgotten.
ALTER TABLE call_sequences ADD COLUMN sent_key_first_at_us bigint;
