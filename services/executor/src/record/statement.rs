//! The text of the fenced write: one execution's ([`fenced_statement`]) and many
//! executions' together ([`fenced_together_statement`]), each naming only the
//! tables its writes touch.

use crate::lease::STILL_RUNNING;

/// Which of a fenced write's optional parts a statement carries: each shape is one
/// prepared statement, and a statement locks no table it does not write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Shape {
    /// Reads the step's call `seq`, made at 0 the first time.
    pub sequence: bool,
    /// Stores a finished step's output.
    pub checkpoint: bool,
    /// Names the key this generation's call of the step sends (a call intent).
    pub sent: bool,
}

impl Shape {
    /// The parts either shape carries.
    pub fn with(self, other: Shape) -> Shape {
        Shape {
            sequence: self.sequence || other.sequence,
            checkpoint: self.checkpoint || other.checkpoint,
            sent: self.sent || other.sent,
        }
    }
}

/// The fenced write of one execution as one statement: the conditional update on
/// the fencing token and phase, then, guarded by it, the step's call `seq`, the
/// checkpoint and the outbox rows bound to `$18` (`outbox_append`). Returns the
/// cancel flag, the lease granted (when renewing) and the `seq`.
pub(crate) fn fenced_statement(shape: Shape) -> String {
    let sequence = if shape.sequence {
        ", step_seq AS ( \
         INSERT INTO call_sequences (task_id, generation, step) SELECT $11, $12, $13 FROM written \
         ON CONFLICT (task_id, generation, step) DO UPDATE SET seq = call_sequences.seq RETURNING seq)"
    } else {
        ""
    };
    let checkpoint = if shape.checkpoint {
        ", stored_checkpoint AS ( \
         INSERT INTO checkpoints (task_id, generation, step, output, sha256, attempt) \
         SELECT $11, $12, $14, $15, $16, $17 FROM written ON CONFLICT DO NOTHING)"
    } else {
        ""
    };
    let sent = if shape.sent {
        ", sent AS ( \
         UPDATE call_sequences SET sent_key = $7, sent_key_first_at_us = CASE \
             WHEN call_sequences.sent_key IS NOT DISTINCT FROM $7 THEN call_sequences.sent_key_first_at_us \
             ELSE (SELECT now_us FROM clock) END \
         FROM written \
         WHERE call_sequences.task_id = $11 AND call_sequences.generation = $12 AND call_sequences.step = $5)"
    } else {
        ""
    };
    let seq = if shape.sequence { "(SELECT seq FROM step_seq)" } else { "NULL::int" };
    format!(
        "WITH clock AS (SELECT now_us() AS now_us), \
         written AS ( \
             UPDATE executions SET phase = $4, phase_at_us = clock.now_us, \
                 step = COALESCE($5, step), status = $6, operation_key = COALESCE($7, operation_key), \
                 provider_request_id = CASE WHEN $4 = 'call_intent' THEN $8 ELSE COALESCE($8, provider_request_id) END, \
                 lease_expires_at_us = CASE WHEN $9 THEN clock.now_us + $10 ELSE lease_expires_at_us END \
             FROM clock \
             WHERE grant_id = $1 AND fencing_token = $2 AND phase = $3 AND {STILL_RUNNING} \
             RETURNING cancel_requested, CASE WHEN $9 THEN lease_expires_at_us - clock.now_us END AS granted_us)\
         {sequence}{checkpoint}{sent} \
         SELECT written.cancel_requested, written.granted_us, {seq}, outbox_append($18::outbox_entry[]) FROM written"
    )
}

/// The fenced writes of many executions as one statement: [`fenced_statement`]'s
/// parts over the rows of `given` (the `$1`..`$17` arrays, one element a write,
/// numbered from 1 as `n`; `$10`, the lease's length, is one value), each guarded
/// by its own write's update. The outbox rows `$18` belong to the writes `$19`
/// names, and only those of writes that matched are appended, in the order given.
/// Returns, for each write that matched, its `n`, the cancel flag, the lease
/// granted and the `seq`. The writes name distinct tasks, so no two parts of the
/// statement touch one row.
pub(crate) fn fenced_together_statement(shape: Shape) -> String {
    let sequence = if shape.sequence {
        ", step_seq AS ( \
         INSERT INTO call_sequences (task_id, generation, step) \
         SELECT g.task_id, g.generation, g.sequence_of FROM given g JOIN written w ON w.n = g.n \
         WHERE g.sequence_of IS NOT NULL \
         ON CONFLICT (task_id, generation, step) DO UPDATE SET seq = call_sequences.seq \
         RETURNING task_id, generation, step, seq)"
    } else {
        ""
    };
    let checkpoint = if shape.checkpoint {
        ", stored_checkpoint AS ( \
         INSERT INTO checkpoints (task_id, generation, step, output, sha256, attempt) \
         SELECT g.task_id, g.generation, g.checkpoint_step, g.checkpoint_output, g.checkpoint_sha256, g.attempt \
         FROM given g JOIN written w ON w.n = g.n WHERE g.checkpoint_step IS NOT NULL ON CONFLICT DO NOTHING)"
    } else {
        ""
    };
    let sent = if shape.sent {
        ", sent AS ( \
         UPDATE call_sequences SET sent_key = g.operation_key, sent_key_first_at_us = CASE \
             WHEN call_sequences.sent_key IS NOT DISTINCT FROM g.operation_key \
             THEN call_sequences.sent_key_first_at_us ELSE (SELECT now_us FROM clock) END \
         FROM given g JOIN written w ON w.n = g.n \
         WHERE g.to_phase = 'call_intent' AND g.operation_key IS NOT NULL AND g.to_step IS NOT NULL \
             AND call_sequences.task_id = g.task_id AND call_sequences.generation = g.generation \
             AND call_sequences.step = g.to_step)"
    } else {
        ""
    };
    let (seq, seq_join) = if shape.sequence {
        (
            "s.seq",
            "LEFT JOIN step_seq s ON s.task_id = g.task_id AND s.generation = g.generation AND s.step = g.sequence_of",
        )
    } else {
        ("NULL::int", "")
    };
    format!(
        "WITH clock AS (SELECT now_us() AS now_us), \
         given AS ( \
             SELECT * FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::text[], $5::text[], $6::text[], \
                 $7::text[], $8::text[], $9::boolean[], $11::uuid[], $12::int[], $13::text[], $14::text[], \
                 $15::jsonb[], $16::text[], $17::int[]) WITH ORDINALITY \
             AS g(grant_id, token, was, to_phase, to_step, to_status, operation_key, request_id, renew, task_id, \
                 generation, sequence_of, checkpoint_step, checkpoint_output, checkpoint_sha256, attempt, n)), \
         written AS ( \
             UPDATE executions SET phase = g.to_phase, phase_at_us = clock.now_us, \
                 step = COALESCE(g.to_step, executions.step), status = g.to_status, \
                 operation_key = COALESCE(g.operation_key, executions.operation_key), \
                 provider_request_id = CASE WHEN g.to_phase = 'call_intent' THEN g.request_id \
                     ELSE COALESCE(g.request_id, executions.provider_request_id) END, \
                 lease_expires_at_us = CASE WHEN g.renew THEN clock.now_us + $10 \
                     ELSE executions.lease_expires_at_us END \
             FROM given g, clock \
             WHERE executions.grant_id = g.grant_id AND executions.fencing_token = g.token \
                 AND executions.phase = g.was AND {STILL_RUNNING} \
             RETURNING g.n, executions.cancel_requested, \
                 CASE WHEN g.renew THEN executions.lease_expires_at_us - clock.now_us END AS granted_us)\
         {sequence}{checkpoint}{sent}, \
         appended AS ( \
             SELECT outbox_append(coalesce(array_agg(($18::outbox_entry[])[i] ORDER BY i), '{{}}')) AS rows \
             FROM generate_subscripts($18::outbox_entry[], 1) AS i \
             WHERE ($19::int[])[i] IN (SELECT n FROM written)) \
         SELECT w.n, w.cancel_requested, w.granted_us, {seq} \
         FROM written w JOIN given g ON g.n = w.n {seq_join} \
         WHERE (SELECT rows FROM appended) IS NOT NULL \
         ORDER BY w.n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_carries_the_parts_of_either() {
        let sequence = Shape { sequence: true, ..Shape::default() };
        let sent = Shape { sent: true, ..Shape::default() };
        assert_eq!(sequence.with(sent), Shape { sequence: true, checkpoint: false, sent: true });
        assert_eq!(Shape::default().with(Shape::default()), Shape::default());
    }

    #[test]
    fn a_statement_names_only_the_tables_its_shape_writes() {
        for statement in [fenced_statement(Shape::default()), fenced_together_statement(Shape::default())] {
            assert!(!statement.contains("call_sequences"), "{statement}");
            assert!(!statement.contains("checkpoints"), "{statement}");
        }
        let checkpoint = Shape { checkpoint: true, ..Shape::default() };
        assert!(fenced_together_statement(checkpoint).contains("INSERT INTO checkpoints"));
        assert!(!fenced_together_statement(checkpoint).contains("call_sequences"));
    }
}
