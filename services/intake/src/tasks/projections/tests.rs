//! The projections' one consumer group, against a schema of its own: what the
//! migration that made it carries over from the three groups it replaced.

/// The version of the migration that made `intake.projections` one group.
const ONE_GROUP: i64 = 129;

#[tokio::test]
async fn the_one_group_starts_where_the_three_had_got_to_and_remembers_what_they_remembered() {
    let before = fenceline_store::migrations_where(&crate::MIGRATOR, |version| version < ONE_GROUP);
    let db = fenceline_store::fresh_test_schema(crate::NAME, &[&fenceline_bus::MIGRATOR, &before]).await;
    let pool = &db.pool;
    sqlx::query(
        "INSERT INTO consumer_partitions (consumer_group, topic, partition, epoch, next_offset, owner) VALUES \
         ('p1.intake.status', 'p1.fenceline.status', 0, 3, 40, 'a'), \
         ('p1.intake.status', 'p1.fenceline.status', 1, 2, NULL, 'a'), \
         ('p1.intake.attempts', 'p1.fenceline.attempts', 0, 5, 17, 'b'), \
         ('p1.intake.cases', 'p1.fenceline.recovery', 2, 1, 9, 'c'), \
         ('p1.intake.requests', 'p1.fenceline.intake.requests', 0, 1, 4, 'd')",
    )
    .execute(pool)
    .await
    .expect("the three groups' progress, and the upstream requests'");
    let (end, case, other) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    sqlx::query(
        "INSERT INTO processed_events (consumer_group, event_id) VALUES \
         ('p1.intake.attempts', $1), ('p1.intake.cases', $2), ('p1.intake.requests', $3)",
    )
    .bind(end)
    .bind(case)
    .bind(other)
    .execute(pool)
    .await
    .expect("the event ids they remembered");

    fenceline_store::migrations_where(&crate::MIGRATOR, |version| version >= ONE_GROUP)
        .run(pool)
        .await
        .expect("the migration");

    let progress: Vec<(String, String, i32, Option<i64>)> = sqlx::query_as(
        "SELECT consumer_group, topic, partition, next_offset FROM consumer_partitions ORDER BY 1, 2, 3",
    )
    .fetch_all(pool)
    .await
    .expect("consumer_partitions");
    let of_new: Vec<_> = progress.iter().filter(|(group, ..)| group == "p1.intake.projections").collect();
    assert_eq!(
        of_new,
        [
            &("p1.intake.projections".to_owned(), "p1.fenceline.attempts".to_owned(), 0, Some(17)),
            &("p1.intake.projections".to_owned(), "p1.fenceline.recovery".to_owned(), 2, Some(9)),
            &("p1.intake.projections".to_owned(), "p1.fenceline.status".to_owned(), 0, Some(40)),
            &("p1.intake.projections".to_owned(), "p1.fenceline.status".to_owned(), 1, None),
        ],
        "each partition where its old group had got to: {progress:?}"
    );
    assert_eq!(progress.len(), 5 + 4, "the old groups' rows stay for the previous release: {progress:?}");
    let remembered: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT event_id FROM processed_events WHERE consumer_group = 'p1.intake.projections' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .expect("processed_events");
    let mut expected = vec![end, case];
    expected.sort();
    assert_eq!(remembered, expected, "what the attempts' and the cases' groups remembered, and nothing else");
}
