-- The W3C trace context of the grant, so that the execution a worker claims later
-- joins the task's one trace (docs/operations.md, "Traces").
ALTER TABLE executions ADD COLUMN traceparent text;
