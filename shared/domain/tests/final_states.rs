//! The final states are one list: every SQL list of task states in the services'
//! statements and migrations that names a final state names exactly
//! `TaskState::FINAL`. The lists stay literal in the SQL (a partial index applies
//! only to a query that repeats its predicate); this check keeps them one list.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use fenceline_domain::vocabulary::TaskState;

#[test]
fn every_list_of_final_states_in_the_sql_is_the_domains() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../services");
    let mut files = Vec::new();
    sources(&root, &mut files);
    let finals: BTreeSet<&str> = TaskState::FINAL.iter().map(|state| state.as_str()).collect();
    let mut lists = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read a source file");
        for list in quoted_lists(&text) {
            let words: BTreeSet<&str> = list.iter().map(String::as_str).collect();
            // A list of attempt outcomes or of open states names no `cancelled`.
            if !words.contains(TaskState::Cancelled.as_str()) {
                continue;
            }
            lists += 1;
            assert_eq!(words, finals, "{}: a list of final states that is not TaskState::FINAL", file.display());
        }
    }
    assert!(lists >= 4, "found only {lists} lists of final states under {}: the scan is broken", root.display());
}

/// Every `IN ('a', 'b', ...)` in `text`, as its words.
fn quoted_lists(text: &str) -> Vec<Vec<String>> {
    let mut lists = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("IN ('") {
        let after = &rest[at + 4..];
        let Some(end) = after.find(')') else { break };
        let words = after[..end].split(',').map(|word| word.trim().trim_matches('\'').to_owned()).collect();
        lists.push(words);
        rest = &after[end..];
    }
    lists
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs" || ext == "sql") {
            out.push(path);
        }
    }
}
