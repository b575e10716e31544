//! The settings reference cannot drift from the code: every `FENCELINE_*` variable the
//! services, the shared crates and the tools read is named in a table of
//! docs/configuration.md, and those tables name no variable the code does not read.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The folders whose code reads settings; their `tests/` folders and `#[cfg(test)]`
/// items are left out, since what a test sets is not a setting.
const READERS: [&str; 3] = ["services", "shared", "tools"];

#[test]
fn every_variable_the_code_reads_is_documented_and_no_other() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    for folder in READERS {
        rust_files(&root.join(folder), &mut files);
    }
    assert!(!files.is_empty(), "no source files under {}", root.display());
    let read: BTreeSet<String> = files
        .iter()
        .flat_map(|file| {
            let source = std::fs::read_to_string(file).expect("read a source file");
            string_literals_outside_tests(&source)
        })
        .filter(|literal| is_variable(literal))
        .collect();
    assert!(read.contains("FENCELINE_DATABASE_URL"), "the scan found none of the settings: {read:?}");

    let reference = root.join("docs/configuration.md");
    let text = std::fs::read_to_string(&reference).expect("read docs/configuration.md");
    let (named_first, named_anywhere) = table_variables(&text);

    let undocumented: Vec<_> = read.difference(&named_first).collect();
    assert!(
        undocumented.is_empty(),
        "read by the code but not in the first column of a table of docs/configuration.md: {undocumented:?}"
    );
    let unread: Vec<_> = named_anywhere.difference(&read).collect();
    assert!(unread.is_empty(), "named in a table of docs/configuration.md but read by no code: {unread:?}");
}

/// Every `.rs` file under `dir`, but for `tests/` and `target/` folders and the
/// `tests.rs` files that hold a module's `#[cfg(test)] mod tests;`.
fn rust_files(dir: &Path, into: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).expect("list a source folder");
    for entry in entries {
        let path = entry.expect("a folder entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if path.is_dir() {
            if name != "tests" && name != "target" && !name.starts_with('.') {
                rust_files(&path, into);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            into.push(path);
        }
    }
}

/// `FENCELINE_` followed by capitals, digits and underscores, and nothing else.
fn is_variable(literal: &str) -> bool {
    literal.strip_prefix("FENCELINE_").is_some_and(|rest| {
        !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
    })
}

/// The variables in the tables of the reference: those of each row's first column,
/// and those anywhere in a row.
fn table_variables(text: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut first = BTreeSet::new();
    let mut anywhere = BTreeSet::new();
    for row in text.lines().map(str::trim).filter(|line| line.starts_with('|')) {
        let cells: Vec<&str> = row.trim_matches('|').split('|').collect();
        if let Some(cell) = cells.first() {
            first.extend(variables_in(cell));
        }
        anywhere.extend(variables_in(row));
    }
    (first, anywhere)
}

fn variables_in(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|word| is_variable(word)).map(str::to_owned)
}

/// The contents of the string literals of Rust source, leaving out every item marked
/// `#[cfg(test)]`. A small lexer: comments, raw strings, byte strings, char literals
/// and lifetimes are told apart so that braces inside them do not count.
fn string_literals_outside_tests(source: &str) -> Vec<String> {
    const TEST_ITEM: &str = "#[cfg(test)]";
    let bytes = source.as_bytes();
    let mut literals = Vec::new();
    let mut depth = 0usize;
    // Set between `#[cfg(test)]` and its item's opening brace or closing semicolon.
    let mut test_item_pending = false;
    // The depth inside a test item's braces, while inside them.
    let mut test_body: Option<usize> = None;
    let mut i = 0;
    while i < bytes.len() {
        let in_test = test_item_pending || test_body.is_some();
        let rest = &source[i..];
        let after_identifier = i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            i += rest.find("*/").map_or(rest.len(), |end| end + 2);
        } else if rest.starts_with(TEST_ITEM) {
            test_item_pending = test_body.is_none();
            i += TEST_ITEM.len();
        } else if let Some((content, length)) = (!after_identifier).then(|| raw_string(rest)).flatten() {
            if !in_test {
                literals.push(content.to_owned());
            }
            i += length;
        } else if bytes[i] == b'"' || (rest.starts_with("b\"") && !after_identifier) {
            let open = if bytes[i] == b'"' { 1 } else { 2 };
            let (content, length) = quoted_string(&rest[open..]);
            if !in_test {
                literals.push(content);
            }
            i += open + length;
        } else if bytes[i] == b'\'' {
            i += char_literal_length(rest);
        } else {
            match bytes[i] {
                b'{' => {
                    depth += 1;
                    if test_item_pending {
                        test_item_pending = false;
                        test_body = Some(depth);
                    }
                }
                b'}' => {
                    if test_body == Some(depth) {
                        test_body = None;
                    }
                    depth = depth.saturating_sub(1);
                }
                b';' if test_item_pending => test_item_pending = false,
                _ => {}
            }
            i += rest.chars().next().map_or(1, char::len_utf8);
        }
    }
    literals
}

/// A raw string (`r"…"`, `r#"…"#`, `br"…"`) at the start of `rest`: its content and
/// its whole length.
fn raw_string(rest: &str) -> Option<(&str, usize)> {
    let after_prefix = rest.strip_prefix("br").or_else(|| rest.strip_prefix('r'))?;
    let hashes = after_prefix.bytes().take_while(|&b| b == b'#').count();
    let body = after_prefix[hashes..].strip_prefix('"')?;
    let close = format!("\"{}", "#".repeat(hashes));
    let end = body.find(&close)?;
    let prefix = rest.len() - after_prefix.len();
    Some((&body[..end], prefix + hashes + 1 + end + close.len()))
}

/// A string after its opening quote: its content (escapes kept as written) and the
/// length up to and including the closing quote.
fn quoted_string(body: &str) -> (String, usize) {
    let mut content = String::new();
    let mut chars = body.char_indices();
    while let Some((at, c)) = chars.next() {
        match c {
            '\\' => {
                content.push(c);
                if let Some((_, escaped)) = chars.next() {
                    content.push(escaped);
                }
            }
            '"' => return (content, at + 1),
            _ => content.push(c),
        }
    }
    (content, body.len())
}

/// The length of a char literal (`'x'`, `'\n'`, `'\u{7f}'`) at the start of `rest`,
/// or 1 for the quote of a lifetime or a label.
fn char_literal_length(rest: &str) -> usize {
    let after = &rest[1..];
    if after.starts_with('\\') {
        // The quote, the backslash and the escaped character, then up to the closing quote.
        return after.get(2..).and_then(|tail| tail.find('\'')).map_or(1, |end| end + 4);
    }
    match after.chars().next() {
        Some(c) if after[c.len_utf8()..].starts_with('\'') => 2 + c.len_utf8(),
        _ => 1,
    }
}

#[test]
fn the_lexer_leaves_out_test_items_and_sees_through_braces_in_literals() {
    let source = r##"
        const A: &str = "FENCELINE_A";
        const BRACE: char = '{';
        const QUOTE: char = '\'';
        fn f<'a>(x: &'a str) -> String { format!("{{{x}") }
        const RAW: &str = r#"FENCELINE_RAW"#;
        #[cfg(test)]
        mod tests {
            const T: &str = "FENCELINE_T";
            fn g() { let _ = "}"; }
        }
        // "FENCELINE_COMMENT"
        const B: &str = "FENCELINE_B";
    "##;
    let found: Vec<String> =
        string_literals_outside_tests(source).into_iter().filter(|literal| is_variable(literal)).collect();
    assert_eq!(found, ["FENCELINE_A", "FENCELINE_RAW", "FENCELINE_B"]);
}
