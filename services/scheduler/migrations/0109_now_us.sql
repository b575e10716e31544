-- The database's clock in micros since the epoch: the one clock slot expiry uses
-- (docs/execution.md, "Slots"). Every scheduler instance writes and compares
-- `expires_at_us` by it, so two hosts whose clocks differ agree on which slots
-- live. One definition for every statement of this service, so that each
-- statement is whole where it is written. Do not change its units. `clock_timestamp()`, not `now()`: the
-- instant of the read, not of the transaction's start.
CREATE FUNCTION now_us() RETURNS bigint LANGUAGE sql VOLATILE
    AS $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint $$;
