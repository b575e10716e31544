//! How output looks where it goes: on a terminal colour (unless `NO_COLOR`), lines
//! cut to its width, short ids and relative times (unless `--wide`); piped, the
//! full values and nothing else; and relative instants (`1h`, `30m`) on the
//! command line.

use std::io::IsTerminal as _;

use fenceline_domain::vocabulary::TaskState;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// How the output of one run looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Look {
    /// ANSI colour: only on a terminal, and never with `NO_COLOR` or `TERM=dumb`.
    pub colour: bool,
    /// Full ids and instants instead of short ids and relative times.
    pub wide: bool,
    /// The terminal's width, to cut long lines to; `None` when piped.
    pub width: Option<usize>,
}

impl Look {
    /// As plain as a script wants it: no colour, full values, no width.
    pub const PLAIN: Look = Look { colour: false, wide: true, width: None };

    /// What standard output is, and what the environment asks for. Piped, output
    /// is for a script: full values, no colour, no width (as `gh` does).
    pub fn detect(wide: bool) -> Look {
        let terminal = std::io::stdout().is_terminal();
        let no_colour = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty())
            || std::env::var("TERM").is_ok_and(|t| t == "dumb");
        let width = terminal.then(|| terminal_size::terminal_size().map(|(w, _)| usize::from(w.0))).flatten();
        Look { colour: terminal && !no_colour, wide: wide || !terminal, width }
    }

    /// A task id as a list shows it: in full when wide, else its last 12 hex
    /// digits (a UUIDv7's random part: the first ones are the time, alike for
    /// tasks made together).
    pub fn task_id(&self, id: &str) -> String {
        if self.wide {
            id.to_owned()
        } else {
            id.chars().rev().take(12).collect::<Vec<_>>().into_iter().rev().collect()
        }
    }

    /// An RFC 3339 instant as a list shows it: as given when wide, else how long ago.
    pub fn instant(&self, at: &str, now: OffsetDateTime) -> String {
        match OffsetDateTime::parse(at, &Rfc3339) {
            Ok(then) if !self.wide => ago(now - then),
            _ => at.to_owned(),
        }
    }

    /// A state, coloured by what it asks of a person when colour is on.
    pub fn state(&self, state: TaskState) -> String {
        let text = state.as_str();
        if !self.colour {
            return text.to_owned();
        }
        let code = match state {
            TaskState::Succeeded => "32",
            TaskState::Failed | TaskState::Cancelled => "31",
            TaskState::OutcomeUnknown | TaskState::NeedsHuman | TaskState::AwaitingApproval => "1;33",
            TaskState::Running => "36",
            TaskState::Queued | TaskState::Waiting => "2",
        };
        format!("\u{1b}[{code}m{text}\u{1b}[0m")
    }

    /// `line` cut to the terminal's width, with `…` where it was cut.
    pub fn fit(&self, line: &str) -> String {
        let Some(width) = self.width.filter(|w| *w > 1) else { return line.to_owned() };
        // Escape sequences take no room on the screen.
        let visible = strip_escapes(line).chars().count();
        if visible <= width {
            return line.to_owned();
        }
        let (mut shown, mut out, mut chars) = (0, String::new(), line.chars().peekable());
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                out.push(c);
                for c in chars.by_ref() {
                    out.push(c);
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
                continue;
            }
            if shown + 1 >= width {
                break;
            }
            out.push(c);
            shown += 1;
        }
        if self.colour {
            out.push_str("\u{1b}[0m");
        }
        out.push('…');
        out
    }
}

fn strip_escapes(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// How long ago, in the largest unit that fits: `12s ago`, `5m ago`, `3h ago`, `2d ago`.
pub fn ago(span: time::Duration) -> String {
    let seconds = span.whole_seconds();
    if seconds < 0 {
        return "in the future".to_owned();
    }
    match seconds {
        0..60 => format!("{seconds}s ago"),
        60..3_600 => format!("{}m ago", seconds / 60),
        3_600..86_400 => format!("{}h ago", seconds / 3_600),
        _ => format!("{}d ago", seconds / 86_400),
    }
}

/// An instant on the command line: RFC 3339 as it is, or a span back from `now`
/// (`90s`, `30m`, `1h`, `2d`, `1w`) as the RFC 3339 instant it names.
pub fn instant_arg(text: &str, now: OffsetDateTime) -> Result<String, String> {
    if OffsetDateTime::parse(text, &Rfc3339).is_ok() {
        return Ok(text.to_owned());
    }
    let refuse = || format!("`{text}` is neither an RFC 3339 instant nor a span back from now such as 30m, 1h or 2d");
    let unit = text.chars().last().ok_or_else(refuse)?;
    let amount: i64 = text[..text.len() - unit.len_utf8()].parse().map_err(|_| refuse())?;
    let seconds = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3_600,
        'd' => 86_400,
        'w' => 604_800,
        _ => return Err(refuse()),
    };
    let then = amount
        .checked_mul(seconds)
        .filter(|s| *s >= 0)
        .and_then(|s| now.checked_sub(time::Duration::seconds(s)))
        .ok_or_else(refuse)?;
    then.format(&Rfc3339).map_err(|_| refuse())
}

#[cfg(test)]
mod tests {
    use time::macros::datetime;

    use super::*;

    const NOW: OffsetDateTime = datetime!(2026-12-03 12:00:00 UTC);

    #[test]
    fn spans_back_from_now_name_instants_and_instants_pass_through() {
        assert_eq!(instant_arg("1h", NOW).as_deref(), Ok("2026-12-03T11:00:00Z"));
        assert_eq!(instant_arg("30m", NOW).as_deref(), Ok("2026-12-03T11:30:00Z"));
        assert_eq!(instant_arg("2d", NOW).as_deref(), Ok("2026-12-01T12:00:00Z"));
        assert_eq!(instant_arg("2026-12-01T10:00:00Z", NOW).as_deref(), Ok("2026-12-01T10:00:00Z"));
        for bad in ["", "h", "1y", "-1h", "yesterday", "1.5h"] {
            assert!(instant_arg(bad, NOW).is_err(), "{bad} was taken");
        }
    }

    #[test]
    fn a_narrow_look_shortens_ids_and_times_and_a_wide_one_keeps_them() {
        let narrow = Look { colour: false, wide: false, width: None };
        let id = "01a23def-c764-7512-8daf-ebb147bba7a3";
        assert_eq!(narrow.task_id(id), "ebb147bba7a3");
        assert_eq!(Look::PLAIN.task_id(id), id);
        assert_eq!(narrow.instant("2026-12-03T11:58:30Z", NOW), "1m ago");
        assert_eq!(narrow.instant("2026-12-01T11:00:00Z", NOW), "2d ago");
        assert_eq!(Look::PLAIN.instant("2026-12-01T11:00:00Z", NOW), "2026-12-01T11:00:00Z");
    }

    #[test]
    fn colour_only_when_asked_and_lines_cut_to_the_width() {
        let plain = Look { colour: false, wide: false, width: Some(10) };
        assert_eq!(plain.state(TaskState::Failed), "failed");
        assert_eq!(plain.fit("0123456789abcdef"), "012345678…");
        assert_eq!(plain.fit("short"), "short");
        let coloured = Look { colour: true, ..plain };
        let state = coloured.state(TaskState::Failed);
        assert!(state.starts_with("\u{1b}[31m") && state.ends_with("\u{1b}[0m"));
        let cut = coloured.fit(&format!("{state} and a long reason"));
        assert_eq!(strip_escapes(&cut).chars().count(), 10, "{cut:?}");
        assert!(Look::PLAIN.fit(&"x".repeat(500)).len() == 500, "piped: never cut");
    }
}
