-- A resolution keeps what it was made on and who made it: the person's name (beside
-- the token's identity), their note, and the case's evidence as it was shown.
ALTER TABLE resolutions ADD COLUMN token_identity text, ADD COLUMN note text, ADD COLUMN evidence jsonb;
