//! The benchmark's chart: an SVG drawn from the figures of `bench.json`, two panels
//! (sustained throughput of Fenceline and its peers; latency from submit to
//! `succeeded` by offered load or, in a run without the `loads` scenario, from
//! submission to the final state of Fenceline and each peer side by side, on a
//! logarithmic scale), written by hand so the chart needs no plotting crate.

use std::fmt::Write as _;

use serde_json::Value;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 420.0;
const PANEL: f64 = 440.0;
const TOP: f64 = 60.0;
const BOTTOM: f64 = 340.0;

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn text(svg: &mut String, x: f64, y: f64, anchor: &str, size: u32, content: &str) {
    let _ = writeln!(
        svg,
        r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}" font-size="{size}">{}</text>"#,
        escape(content)
    );
}

/// Bars of `values` (label, value) in a panel starting at `left`, on a linear scale.
fn throughput_panel(svg: &mut String, left: f64, values: &[(String, f64, &str)]) {
    text(svg, left + PANEL / 2.0, 30.0, "middle", 15, "Sustained throughput (tasks/s, median)");
    let max = values.iter().map(|v| v.1).fold(1.0, f64::max) * 1.15;
    let slot = (PANEL - 40.0) / values.len().max(1) as f64;
    let _ = writeln!(
        svg,
        r##"<line x1="{:.1}" y1="{BOTTOM}" x2="{:.1}" y2="{BOTTOM}" stroke="#333"/>"##,
        left + 30.0,
        left + PANEL
    );
    for (i, (label, value, colour)) in values.iter().enumerate() {
        let height = (BOTTOM - TOP) * value / max;
        let x = left + 40.0 + i as f64 * slot;
        let _ = writeln!(
            svg,
            r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{height:.1}" fill="{colour}"/>"#,
            BOTTOM - height,
            slot * 0.7
        );
        text(svg, x + slot * 0.35, BOTTOM - height - 6.0, "middle", 12, &format!("{value:.0}"));
        for (n, part) in label.split('\n').enumerate() {
            text(svg, x + slot * 0.35, BOTTOM + 16.0 + 14.0 * n as f64, "middle", 11, part);
        }
    }
}

/// Grouped bars of p50 and p99 per group (an offered load, or a system), on a log
/// scale from 1 ms, under `title` and over `axis`.
fn latency_panel(svg: &mut String, left: f64, groups: &[(String, f64, f64)], title: &str, axis: &str) {
    text(svg, left + PANEL / 2.0, 30.0, "middle", 15, title);
    let top = groups.iter().map(|g| g.2.max(g.1)).fold(10.0, f64::max);
    // Headroom above the tallest bar, for its figure below the legend.
    let decades = (top * 2.0).log10().ceil().max(1.0);
    let y = |ms: f64| BOTTOM - (BOTTOM - TOP) * (ms.max(1.0).log10() / decades);
    for decade in 0..=decades as i32 {
        let at = y(10f64.powi(decade));
        let _ = writeln!(
            svg,
            r##"<line x1="{:.1}" y1="{at:.1}" x2="{:.1}" y2="{at:.1}" stroke="#ddd"/>"##,
            left + 40.0,
            left + PANEL
        );
        text(svg, left + 36.0, at + 4.0, "end", 11, &format!("{}", 10u64.pow(decade as u32)));
    }
    let slot = (PANEL - 50.0) / groups.len().max(1) as f64;
    for (i, (label, p50, p99)) in groups.iter().enumerate() {
        let x = left + 50.0 + i as f64 * slot;
        for (j, (value, colour)) in [(*p50, "#4e79a7"), (*p99, "#e15759")].into_iter().enumerate() {
            let bar_x = x + j as f64 * slot * 0.38;
            let _ = writeln!(
                svg,
                r#"<rect x="{bar_x:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{colour}"/>"#,
                y(value),
                slot * 0.36,
                BOTTOM - y(value)
            );
            text(svg, bar_x + slot * 0.18, y(value) - 4.0, "middle", 10, &format!("{value:.0}"));
        }
        for (n, part) in label.split('\n').enumerate() {
            text(svg, x + slot * 0.37, BOTTOM + 16.0 + 14.0 * n as f64, "middle", 11, part);
        }
    }
    text(svg, left + PANEL / 2.0, BOTTOM + 50.0, "middle", 11, axis);
    let _ = writeln!(svg, r##"<rect x="{:.1}" y="44" width="10" height="10" fill="#4e79a7"/>"##, left + PANEL - 120.0);
    text(svg, left + PANEL - 106.0, 53.0, "start", 11, "p50");
    let _ = writeln!(svg, r##"<rect x="{:.1}" y="44" width="10" height="10" fill="#e15759"/>"##, left + PANEL - 70.0);
    text(svg, left + PANEL - 56.0, 53.0, "start", 11, "p99");
}

/// The durable engines of the `peer` scenario: their key, label and colour.
const DURABLE_PEERS: [(&str, &str, &str); 2] = [("dbos", "DBOS", "#59a14f"), ("temporal", "Temporal dev", "#b07aa1")];

/// p50 and p99 from submission to the final state in the closed loop: Fenceline's
/// one-step kind, pgqueuer's no-op job and each durable engine's one-step job.
fn side_by_side(report: &Value) -> Vec<(String, f64, f64)> {
    let mut groups = Vec::new();
    let mut push = |label: &str, l: &Value| {
        if let (Some(p50), Some(p99)) = (l["p50"].as_f64(), l["p99"].as_f64()) {
            groups.push((label.to_owned(), p50, p99));
        }
    };
    push("Fenceline\none step", &report["throughput"]["image.generate"]["median"]["latency_ms"]["submit_to_succeeded"]);
    push("pgqueuer\nno-op", &report["peer"]["median"]["end_to_end_ms"]);
    for (name, label, _) in DURABLE_PEERS {
        push(&format!("{label}\none step"), &report["peer"][name]["median"]["latency_ms"]["submit_to_final_state"]);
    }
    groups
}

/// The chart of a report (missing scenarios leave their bars out).
pub fn draw(report: &Value) -> String {
    let mut bars: Vec<(String, f64, &str)> = Vec::new();
    let median = |v: &Value| v["median"]["throughput_per_s"].as_f64();
    if let Some(v) = median(&report["throughput"]["image.generate"]) {
        bars.push(("one step".into(), v, "#4e79a7"));
    }
    if let Some(v) = median(&report["throughput"]["ticket.reply"]) {
        bars.push(("three steps".into(), v, "#4e79a7"));
    }
    if let Some(executors) = report["executors"].as_object() {
        for (count, figures) in executors {
            if let Some(v) = median(figures) {
                bars.push((format!("one step\n{count} executor"), v, "#76b7b2"));
            }
        }
    }
    let peer = &report["peer"];
    if let Some(v) = peer["median"]["sustained_per_s"].as_f64() {
        bars.push(("pgqueuer\n(no-op job)".into(), v, "#f28e2b"));
    }
    for (name, label, colour) in DURABLE_PEERS {
        if let Some(v) = peer[name]["median"]["sustained_per_s"].as_f64() {
            bars.push((format!("{label}\n(one step)"), v, colour));
        }
    }
    let mut groups = Vec::new();
    if let Some(loads) = report["loads"].as_object() {
        let mut keys: Vec<&String> = loads.keys().collect();
        keys.sort_by_key(|k| k.parse::<u64>().unwrap_or(u64::MAX));
        for key in keys {
            let l = &loads[key]["median"]["latency_ms"]["submit_to_succeeded"];
            if let (Some(p50), Some(p99)) = (l["p50"].as_f64(), l["p99"].as_f64()) {
                groups.push((if key == "saturation" { "saturated".to_owned() } else { key.clone() }, p50, p99));
            }
        }
    }
    let (title, axis) = if groups.is_empty() {
        groups = side_by_side(report);
        ("Submit to final state, closed loop (ms, log)", "")
    } else {
        ("Submit to succeeded (ms, log scale)", "offered load (tasks/s)")
    };
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    throughput_panel(&mut svg, 20.0, &bars);
    latency_panel(&mut svg, 500.0, &groups, title, axis);
    let machine = &report["machine"];
    text(
        &mut svg,
        WIDTH / 2.0,
        HEIGHT - 12.0,
        "middle",
        11,
        &format!(
            "Fenceline on {} cores ({}), load average at start {}; docs/performance.md",
            machine["cores"],
            machine["cpu"].as_str().unwrap_or("?"),
            machine["load_average"].as_str().unwrap_or("?")
        ),
    );
    svg.push_str("</svg>\n");
    svg
}
