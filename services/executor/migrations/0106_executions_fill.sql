-- Room on each page of `executions` for the updates of a running execution
-- (docs/decisions.md, entry 47): its phase, step, operation key and provider
-- request id change no indexed column, so each is written in place (HOT) when its
-- page has room, with no index entry. New pages keep a fifth free; pages written
-- before keep theirs as they are.
ALTER TABLE executions SET (fillfactor = 80);
