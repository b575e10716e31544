-- The W3C trace context of each grant and case, as the handler that recorded it
-- saw it, so that a re-issue and the look-ups the reconciler makes later join the
-- task's one trace (docs/operations.md, "Traces").
ALTER TABLE grants ADD COLUMN traceparent text;
ALTER TABLE cases ADD COLUMN traceparent text;
