-- The database's clock in micros since the epoch: the one clock this service's
-- leases, windows and timers are written and judged by, whichever host reads it.
-- One definition for every statement of the service, so that each statement is
-- whole where it is written. Do not change its units. `clock_timestamp()`, not
-- `now()`: the instant of the read, not of the transaction's start.
CREATE FUNCTION now_us() RETURNS bigint LANGUAGE sql VOLATILE
    AS $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint $$;
