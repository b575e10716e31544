-- What was heard of a grant before the grant itself: fenceline.attempts and
-- fenceline.dispatch keep no order between them, so a claim, an end or a cancel can
-- arrive first. Applied (and removed) when the grant arrives, so that a grant that
-- was claimed, ended or cancelled is never re-issued.
CREATE TABLE early_grant_facts (
    grant_id uuid PRIMARY KEY,
    claimed boolean NOT NULL DEFAULT false,
    ended boolean NOT NULL DEFAULT false,
    heard_at timestamptz NOT NULL DEFAULT now()
);
