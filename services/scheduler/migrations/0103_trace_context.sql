-- The W3C trace context of the task's TaskAccepted, so that what the dispatcher
-- does later (grants, expired deadlines) joins the task's one trace
-- (docs/operations.md, "Traces").
ALTER TABLE tasks ADD COLUMN traceparent text;
