//! Pictures, as hand-written SVG: the pool's chunks, and bytes over a replay.
//!
//! - [`pool_state`]: one bar per chunk of a [`PoolSnapshot`], grouped by memory kind. Each
//!   pixel column of a bar stacks, bottom to top, the share of its bytes that are allocated
//!   (requested by live segments), padding (what the carve rule adds after each segment:
//!   rounding to 32, the 32-byte pad, the round up to the start alignment) and free. The
//!   label gives the exact shares of the whole chunk, since one segment's padding is often
//!   far below a pixel.
//! - [`timeline`]: live requested, live required (rule-mandated footprints) and reserved
//!   bytes over a replay's events, from [`ReplayReport::timeline`](crate::trace::ReplayReport).
//!
//! Both return a complete SVG document as a `String`; nothing here touches memory or files.

use std::fmt::Write as _;

use crate::pool::{ChunkInfo, PoolSnapshot};
use crate::trace::TimelinePoint;

/// Width of every picture, px.
const WIDTH: u32 = 960;
/// Left margin (labels), px.
const LABEL_W: u32 = 250;
/// Height of one chunk bar, px.
const BAR_H: u32 = 14;
/// Vertical space per chunk row, px.
const ROW_H: u32 = 20;

const ALLOCATED: &str = "#4e79a7";
const PADDING: &str = "#f28e2b";
const FREE: &str = "#dcdcdc";
const REQUESTED: &str = "#4e79a7";
const REQUIRED: &str = "#f28e2b";
const RESERVED: &str = "#59a14f";

/// Escapes text for an SVG text node or attribute. Characters XML 1.0 does not allow in a
/// document at all, escaped or not (control characters but tab and line ends, U+FFFE and
/// U+FFFF), become U+FFFD: a title comes from a file name, which may hold any of them.
fn esc(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '\t' | '\n' | '\r' => c,
            '\u{0}'..='\u{1f}' | '\u{fffe}' | '\u{ffff}' => '\u{fffd}',
            c => c,
        })
        .collect::<String>()
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Bytes as MiB (or GiB past 10 GiB) with two decimals.
fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 10.0 * (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.2} MiB", b / (1u64 << 20) as f64)
    }
}

/// Allocated, padding and free bytes in each of `columns` equal slices of a chunk.
fn chunk_columns(chunk: &ChunkInfo, columns: usize) -> Vec<[f64; 3]> {
    let mut cols = vec![[0.0f64; 3]; columns];
    let size = chunk.size.max(1) as f64;
    let per = size / columns as f64;
    // Adds the bytes of [start, end) to class `c`, split over the columns it covers.
    let mut add = |start: u64, end: u64, c: usize| {
        let (s, e) = (start as f64, (end as f64).min(size));
        if e <= s {
            return;
        }
        let first = ((s / per) as usize).min(columns - 1);
        let last = (((e / per).ceil() as usize).max(first + 1)).min(columns);
        for (i, col) in cols.iter_mut().enumerate().take(last).skip(first) {
            let lo = s.max(i as f64 * per);
            let hi = e.min((i + 1) as f64 * per);
            if hi > lo {
                col[c] += hi - lo;
            }
        }
    };
    // A segment parked in a thread cache is free memory as far as users go.
    // Saturating: a snapshot's fields are public, so one may be made by hand.
    for seg in chunk.segments.iter().filter(|g| !g.cached) {
        let end = seg.offset.saturating_add(seg.len);
        add(seg.offset, end, 0);
        add(end, seg.offset.saturating_add(seg.footprint), 1);
    }
    for col in &mut cols {
        col[2] = (per - col[0] - col[1]).max(0.0);
    }
    cols
}

/// The opening of a picture: the `<svg>` element, a white background and the title.
fn start(w: u32, h: u32, title: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        out,
        r#"<rect width="{w}" height="{h}" fill="white"/><text x="10" y="18" font-size="14" font-weight="bold">{}</text>"#,
        esc(title)
    );
    out
}

/// How legend entries are laid out: `spacing` apart, a `width` x `height` swatch at `y`,
/// the name's baseline at `text_y`.
#[derive(Clone, Copy)]
struct Swatch {
    spacing: u32,
    y: u32,
    text_y: u32,
    width: u32,
    height: u32,
}

/// One row of legend entries (name, colour) under the title.
fn legend(out: &mut String, entries: &[(&str, &str)], s: Swatch) {
    for (i, (name, color)) in entries.iter().enumerate() {
        let x = 10 + i as u32 * s.spacing;
        let _ = writeln!(
            out,
            r#"<rect x="{x}" y="{}" width="{}" height="{}" fill="{color}"/><text x="{}" y="{}">{name}</text>"#,
            s.y,
            s.width,
            s.height,
            x + s.width + 4,
            s.text_y,
        );
    }
}

/// An SVG of every chunk in `snap`: one bar each, allocated / padding / free.
///
/// ```
/// use ascend_pool::{Pool, PoolConfig, SimSource};
/// use std::sync::Arc;
/// let pool = Pool::new(Arc::new(SimSource::default()), PoolConfig::default()).unwrap();
/// let _frame = pool.alloc_dvpp(3_110_400).unwrap();
/// let svg = ascend_pool::svg::pool_state(&pool.snapshot(), "one frame");
/// assert!(svg.starts_with("<svg") && svg.contains("dvpp"));
/// ```
pub fn pool_state(snap: &PoolSnapshot, title: &str) -> String {
    let bar_w = WIDTH - LABEL_W - 10;
    let rows: usize = snap.kinds.iter().map(|k| k.chunks.len() + 1).sum();
    let height = 60 + rows as u32 * ROW_H + 10;
    let mut out = start(WIDTH, height, title);
    let swatch = Swatch {
        spacing: 170,
        y: 28,
        text_y: 38,
        width: 12,
        height: 12,
    };
    legend(
        &mut out,
        &[
            ("allocated", ALLOCATED),
            ("padding (carve rule)", PADDING),
            ("free", FREE),
        ],
        swatch,
    );
    let mut y = 60;
    for kind in &snap.kinds {
        let s = &kind.stats;
        let _ = writeln!(
            out,
            r#"<text x="10" y="{}" font-weight="bold">{}: {} chunk(s), {} reserved, {} live segments</text>"#,
            y + 12,
            kind.stats.kind.trace_name(),
            kind.chunks.len(),
            human(s.reserved_bytes),
            s.live_regions
        );
        y += ROW_H;
        for chunk in &kind.chunks {
            let live = || chunk.segments.iter().filter(|g| !g.cached);
            // Saturating, as in `chunk_columns`.
            let used = live().fold(0u64, |a, g| a.saturating_add(g.len));
            let pad = live().fold(0u64, |a, g| {
                a.saturating_add(g.footprint.saturating_sub(g.len))
            });
            let pct = |b: u64| 100.0 * b as f64 / chunk.size.max(1) as f64;
            let _ = writeln!(
                out,
                r#"<text x="10" y="{}">{}{}: {:.1}% / {:.2}% / {:.1}%</text>"#,
                y + 11,
                human(chunk.size),
                if chunk.dedicated { " dedicated" } else { "" },
                pct(used),
                pct(pad),
                pct(chunk.size.saturating_sub(used.saturating_add(pad)))
            );
            bar(&mut out, chunk, LABEL_W, y, bar_w);
            y += ROW_H;
        }
    }
    out.push_str("</svg>\n");
    out
}

/// Draws one chunk's bar at (`x`, `y`), `w` px wide, merging equal neighbouring columns.
fn bar(out: &mut String, chunk: &ChunkInfo, x: u32, y: u32, w: u32) {
    let cols = chunk_columns(chunk, w as usize);
    // Pixel heights of allocated and padding (free fills the rest) per column.
    let heights: Vec<(u32, u32)> = cols
        .iter()
        .map(|c| {
            let total = (c[0] + c[1] + c[2]).max(1.0);
            let a = (c[0] / total * f64::from(BAR_H)).round() as u32;
            // Any padding at all shows as at least one pixel, so the rule's cost is visible,
            // even in a column that allocation fills: the pixel comes off the allocated part.
            let mut p = (c[1] / total * f64::from(BAR_H)).round() as u32;
            if c[1] > 0.0 && p == 0 {
                p = 1;
            }
            let p = p.min(BAR_H);
            (a.min(BAR_H - p), p)
        })
        .collect();
    let _ = writeln!(
        out,
        r#"<rect x="{x}" y="{y}" width="{w}" height="{BAR_H}" fill="{FREE}"/>"#
    );
    let mut i = 0;
    while i < heights.len() {
        let (a, p) = heights[i];
        let mut j = i + 1;
        while j < heights.len() && heights[j] == (a, p) {
            j += 1;
        }
        let (cx, cw) = (x + i as u32, (j - i) as u32);
        if a > 0 {
            let _ = writeln!(
                out,
                r#"<rect x="{cx}" y="{}" width="{cw}" height="{a}" fill="{ALLOCATED}"/>"#,
                y + BAR_H - a
            );
        }
        if p > 0 {
            let _ = writeln!(
                out,
                r#"<rect x="{cx}" y="{}" width="{cw}" height="{p}" fill="{PADDING}"/>"#,
                y + BAR_H - a - p
            );
        }
        i = j;
    }
    let _ = writeln!(
        out,
        r##"<rect x="{x}" y="{y}" width="{w}" height="{BAR_H}" fill="none" stroke="#888" stroke-width="0.5"/>"##
    );
}

/// Picks one series out of a timeline point.
type Series = fn(&TimelinePoint) -> u64;

/// A round step for about `n` ticks over `0..=max`.
fn tick_step(max: f64, n: f64) -> f64 {
    let raw = (max / n).max(1.0);
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * mag)
}

/// An SVG line chart of live requested, live required and reserved bytes over a replay.
///
/// ```
/// use ascend_pool::trace::TimelinePoint;
/// let pts = [
///     TimelinePoint { op: 1, requested: 100, required: 192, reserved: 2 << 20 },
///     TimelinePoint { op: 2, requested: 0, required: 0, reserved: 2 << 20 },
/// ];
/// let svg = ascend_pool::svg::timeline(&pts, "two events");
/// assert!(svg.contains("<polyline") && svg.contains("reserved"));
/// ```
pub fn timeline(points: &[TimelinePoint], title: &str) -> String {
    let (w, h) = (WIDTH, 420u32);
    let (left, right, top, bottom) = (80.0, 20.0, 60.0, 50.0);
    let pw = f64::from(w) - left - right;
    let ph = f64::from(h) - top - bottom;
    let max_op = points.last().map_or(1, |p| p.op).max(1) as f64;
    let max_b = points
        .iter()
        .map(|p| p.requested.max(p.required).max(p.reserved))
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let mib = (1u64 << 20) as f64;
    let y_step = tick_step(max_b / mib, 5.0) * mib;
    let y_max = (max_b / y_step).ceil() * y_step;
    let x_step = tick_step(max_op, 8.0);
    let px = |op: f64| left + op / max_op * pw;
    let py = |b: f64| top + ph - b / y_max * ph;

    let mut out = start(w, h, title);
    let swatch = Swatch {
        spacing: 220,
        y: 30,
        text_y: 36,
        width: 14,
        height: 4,
    };
    legend(
        &mut out,
        &[
            ("live requested", REQUESTED),
            ("live required (carve rule)", REQUIRED),
            ("reserved from the source", RESERVED),
        ],
        swatch,
    );
    // Axes and grid.
    let mut v = 0.0;
    while v <= y_max + 0.5 {
        let y = py(v);
        let _ = writeln!(
            out,
            r##"<line x1="{left}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e8e8e8"/><text x="{:.1}" y="{:.1}" text-anchor="end">{:.0} MiB</text>"##,
            left + pw,
            left - 6.0,
            y + 4.0,
            v / mib
        );
        v += y_step;
    }
    let mut o = 0.0;
    while o <= max_op {
        let x = px(o);
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{:.1}" stroke="#f0f0f0"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{o:.0}</text>"##,
            top + ph,
            top + ph + 16.0
        );
        o += x_step;
    }
    let _ = writeln!(
        out,
        r##"<text x="{:.1}" y="{}" text-anchor="middle">events replayed (each point: the largest value over its events)</text><rect x="{left}" y="{top}" width="{pw:.1}" height="{ph:.1}" fill="none" stroke="#888"/>"##,
        left + pw / 2.0,
        h - 10
    );
    // Required is drawn last and dashed: it hugs the requested line (the rule adds little).
    let series: [(&str, &str, Series); 3] = [
        (RESERVED, "", |p| p.reserved),
        (REQUESTED, "", |p| p.requested),
        (REQUIRED, r#" stroke-dasharray="4 3""#, |p| p.required),
    ];
    for (color, dash, get) in series {
        let mut pts = String::new();
        for p in points {
            let _ = write!(pts, "{:.1},{:.1} ", px(p.op as f64), py(get(p) as f64));
        }
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{}"/>"#,
            pts.trim_end()
        );
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{KindSnapshot, KindStats, SegmentInfo};
    use crate::MemKind;

    fn chunk(size: u64, segs: &[(u64, u64, u64)]) -> ChunkInfo {
        ChunkInfo {
            addr: 0,
            size,
            dedicated: false,
            engine: Default::default(),
            segments: segs
                .iter()
                .map(|&(offset, len, footprint)| SegmentInfo {
                    kind: MemKind::Host,
                    addr: offset as usize,
                    offset,
                    len,
                    footprint,
                    pending: false,
                    cached: false,
                })
                .collect(),
        }
    }

    #[test]
    fn columns_add_up_and_split_segments() {
        // 4 columns of 100 bytes; a segment of 150 + 10 padding at 50.
        let c = chunk_columns(&chunk(400, &[(50, 150, 160)]), 4);
        assert_eq!(c[0], [50.0, 0.0, 50.0]);
        assert_eq!(c[1], [100.0, 0.0, 0.0]);
        assert_eq!(c[2], [0.0, 10.0, 90.0]);
        assert_eq!(c[3], [0.0, 0.0, 100.0]);
        for col in c {
            assert!((col.iter().sum::<f64>() - 100.0).abs() < 1e-9);
        }
    }

    #[test]
    fn state_picture_has_a_bar_per_chunk_and_exact_shares() {
        // KindStats has no public constructor: take one from a real pool.
        let pool = crate::Pool::new(
            std::sync::Arc::new(crate::SimSource::default()),
            crate::PoolConfig::default(),
        )
        .unwrap();
        let mut stats: KindStats = pool.stats(MemKind::Host);
        stats.reserved_bytes = 2000;
        let snap = PoolSnapshot {
            source: "sim".into(),
            device: 0,
            device_reserved_bytes: 0,
            total_limit: None,
            kinds: vec![KindSnapshot {
                stats,
                chunks: vec![chunk(1000, &[(0, 500, 520)]), chunk(1000, &[])],
            }],
        };
        let svg = pool_state(&snap, "a <title> & more");
        assert!(svg.contains("a &lt;title&gt; &amp; more"));
        assert!(svg.contains("50.0% / 2.00% / 48.0%"), "{svg}");
        assert!(svg.contains("0.0% / 0.00% / 100.0%"));
        // Two bars, each with its outline.
        assert_eq!(
            svg.matches(r##"stroke="#888" stroke-width="0.5""##).count(),
            2
        );
        assert!(svg.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn timeline_scales_to_the_largest_value() {
        let mib = 1u64 << 20;
        let pts: Vec<TimelinePoint> = (1..=100)
            .map(|i| TimelinePoint {
                op: i,
                requested: i * mib,
                required: i * mib + 1000,
                reserved: 128 * mib,
            })
            .collect();
        let svg = timeline(&pts, "t");
        assert_eq!(svg.matches("<polyline").count(), 3);
        // The axis reaches the reserved 128 MiB: ticks every 50 MiB up to 150.
        assert!(svg.contains(">150 MiB<"), "{svg}");
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        // An empty timeline still renders.
        assert!(timeline(&[], "empty").contains("</svg>"));
    }

    /// The number in attribute `name` of element text `el`, if it has one.
    fn attr(el: &str, name: &str) -> Option<f64> {
        let at = el.find(&format!(" {name}=\""))? + name.len() + 3;
        let end = at + el[at..].find('"')?;
        el[at..end].parse().ok()
    }

    /// Checks that every shape and text of `svg` lies on its canvas, and returns the
    /// canvas size and the `<rect>` elements (as their text) for further checks.
    fn on_canvas(svg: &str) -> ((f64, f64), Vec<String>) {
        let head = svg.lines().next().unwrap();
        let (w, h) = (attr(head, "width").unwrap(), attr(head, "height").unwrap());
        let inside = |x: f64, y: f64, what: &str| {
            assert!(
                (0.0..=w).contains(&x) && (0.0..=h).contains(&y),
                "({x}, {y}) off the {w} x {h} canvas: {what}"
            );
        };
        let mut rects = Vec::new();
        for el in svg.split('<').skip(1).map(|e| format!("<{e}")) {
            if el.starts_with("<rect") {
                let (x, y) = (attr(&el, "x").unwrap_or(0.0), attr(&el, "y").unwrap_or(0.0));
                let (rw, rh) = (attr(&el, "width").unwrap(), attr(&el, "height").unwrap());
                inside(x, y, &el);
                inside(x + rw, y + rh, &el);
                rects.push(el);
            } else if el.starts_with("<text") {
                inside(attr(&el, "x").unwrap(), attr(&el, "y").unwrap(), &el);
            } else if el.starts_with("<line") {
                inside(attr(&el, "x1").unwrap(), attr(&el, "y1").unwrap(), &el);
                inside(attr(&el, "x2").unwrap(), attr(&el, "y2").unwrap(), &el);
            } else if el.starts_with("<polyline") {
                let at = el.find("points=\"").unwrap() + 8;
                let pts = &el[at..at + el[at..].find('"').unwrap()];
                for xy in pts.split_whitespace() {
                    let (x, y) = xy.split_once(',').unwrap();
                    inside(x.parse().unwrap(), y.parse().unwrap(), &el);
                }
            }
        }
        ((w, h), rects)
    }

    /// Legend entries (swatch x, name) of `svg`: left to right, none overlapping the next
    /// (a name takes at most 7 px per character at this font size).
    fn legend_fits(svg: &str, names: &[&str], swatch_w: f64) {
        let xs: Vec<f64> = names
            .iter()
            .map(|n| {
                let text = svg.find(&format!(">{n}</text>")).unwrap();
                let rect = svg[..text].rfind("<rect").unwrap();
                attr(&svg[rect..text], "x").unwrap()
            })
            .collect();
        for (i, pair) in xs.windows(2).enumerate() {
            let needs = swatch_w + 4.0 + 7.0 * names[i].len() as f64;
            assert!(
                pair[1] - pair[0] >= needs,
                "{:?} overlap: {xs:?}",
                &names[i..=i + 1]
            );
        }
    }

    /// The rects `bar` draws for `chunk` at (`x`, `y`), `w` columns wide: fill and x, y,
    /// width, height.
    fn bar_rects(chunk: &ChunkInfo, x: u32, y: u32, w: u32) -> Vec<(String, [u32; 4])> {
        let mut out = String::new();
        bar(&mut out, chunk, x, y, w);
        out.lines()
            .map(|el| {
                let at = el.find("fill=\"").unwrap() + 6;
                let fill = el[at..at + el[at..].find('"').unwrap()].to_string();
                let n = |a: &str| attr(el, a).unwrap() as u32;
                (fill, [n("x"), n("y"), n("width"), n("height")])
            })
            .collect()
    }

    fn r(fill: &str, xywh: [u32; 4]) -> (String, [u32; 4]) {
        (fill.to_string(), xywh)
    }

    #[test]
    fn a_full_column_keeps_its_padding_pixel_inside_the_bar() {
        // 999 bytes allocated and 1 of padding: allocation alone would round to the full
        // height; the padding pixel is taken from it, on top, within the bar.
        assert_eq!(
            bar_rects(&chunk(1000, &[(0, 999, 1000)]), 2, 7, 1),
            [
                r(FREE, [2, 7, 1, 14]),
                r(ALLOCATED, [2, 8, 1, 13]),
                r(PADDING, [2, 7, 1, 1]),
                r("none", [2, 7, 1, 14]),
            ]
        );
    }

    #[test]
    fn a_bar_stacks_allocated_under_padding_column_by_column() {
        // Ten columns of 100 bytes: half allocated (then 20 bytes of padding), a segment
        // with 1 byte of padding, which still shows as one pixel, and one with 46.
        let c = chunk(1000, &[(0, 500, 520), (600, 50, 51), (800, 50, 96)]);
        assert_eq!(
            bar_rects(&c, 3, 5, 10),
            [
                r(FREE, [3, 5, 10, 14]),
                r(ALLOCATED, [3, 5, 5, 14]),
                r(PADDING, [8, 16, 1, 3]),
                r(ALLOCATED, [9, 12, 1, 7]),
                r(PADDING, [9, 11, 1, 1]),
                r(ALLOCATED, [11, 12, 1, 7]),
                r(PADDING, [11, 6, 1, 6]),
                r("none", [3, 5, 10, 14]),
            ]
        );
    }

    #[test]
    fn sizes_read_in_mib_up_to_ten_gib() {
        assert_eq!(human(3 << 20), "3.00 MiB");
        assert_eq!(human(2 << 30), "2048.00 MiB");
        assert_eq!(human((10 << 30) - 1), "10240.00 MiB");
        assert_eq!(human(10 << 30), "10.00 GiB");
        assert_eq!(human(48 << 30), "48.00 GiB");
    }

    #[test]
    fn the_state_picture_fits_its_canvas_row_by_row() {
        let pool = crate::Pool::new(
            std::sync::Arc::new(crate::SimSource::default()),
            crate::PoolConfig::default(),
        )
        .unwrap();
        let mut held = Vec::new();
        for i in 1..40u64 {
            held.push(pool.alloc_host(i * 70_001).unwrap());
        }
        let frame = pool.alloc_dvpp(3_110_400).unwrap();
        let snap = pool.snapshot();
        let chunks: usize = snap.kinds.iter().map(|k| k.chunks.len()).sum();
        assert!(chunks >= 3 && snap.kinds.len() >= 2, "{chunks} chunks");
        let svg = pool_state(&snap, "rows");
        let ((_, h), rects) = on_canvas(&svg);
        legend_fits(&svg, &["allocated", "padding (carve rule)", "free"], 12.0);
        // One outline per chunk, each row below the last, and no empty band at the bottom.
        let outlines: Vec<f64> = rects
            .iter()
            .filter(|r| r.contains("stroke-width=\"0.5\""))
            .map(|r| attr(r, "y").unwrap())
            .collect();
        assert_eq!(outlines.len(), chunks);
        for pair in outlines.windows(2) {
            assert!(pair[1] >= pair[0] + f64::from(ROW_H), "{outlines:?}");
        }
        let bottom = outlines.last().unwrap() + f64::from(BAR_H);
        assert!(
            h - bottom <= f64::from(ROW_H),
            "{h} for a last bar ending at {bottom}"
        );
        drop((held, frame));
    }

    #[test]
    fn the_timeline_fits_its_canvas() {
        let mib = 1u64 << 20;
        let pts: Vec<TimelinePoint> = (1..=500)
            .map(|i| TimelinePoint {
                op: i * 7,
                requested: (i % 97) * mib,
                required: (i % 97) * mib + 4096,
                reserved: (64 + i / 5) * mib,
            })
            .collect();
        let svg = timeline(&pts, "fits");
        on_canvas(&svg);
        legend_fits(
            &svg,
            &[
                "live requested",
                "live required (carve rule)",
                "reserved from the source",
            ],
            14.0,
        );
    }

    #[test]
    fn the_timeline_maps_events_and_bytes_onto_its_plot() {
        let mib = 1u64 << 20;
        let pts: Vec<TimelinePoint> = (0..=100)
            .map(|i| TimelinePoint {
                op: i,
                requested: i * mib,
                required: i * mib,
                reserved: 100 * mib,
            })
            .collect();
        let svg = timeline(&pts, "plot");
        // The plot's frame: 80 px left for the byte labels, 20 right, 60 above, 50 below.
        let frame = svg
            .split('<')
            .find(|e| e.starts_with("rect") && e.contains("stroke=\"#888\""))
            .unwrap();
        let at = |a: &str| attr(frame, a).unwrap();
        assert_eq!(
            [at("x"), at("y"), at("width"), at("height")],
            [80.0, 60.0, f64::from(WIDTH) - 100.0, 310.0]
        );
        // Requested bytes grow from the plot's bottom left corner to its top right one.
        let line = svg
            .split('<')
            .find(|e| e.starts_with(&format!("polyline fill=\"none\" stroke=\"{REQUESTED}\"")))
            .unwrap();
        let at = line.find("points=\"").unwrap() + 8;
        let xy: Vec<&str> = line[at..at + line[at..].find('"').unwrap()]
            .split(' ')
            .collect();
        assert_eq!(xy.len(), 101);
        let right = f64::from(WIDTH) - 20.0;
        assert_eq!(xy[0], "80.0,370.0");
        assert_eq!(xy[50], format!("{:.1},215.0", 80.0 + (right - 80.0) / 2.0));
        assert_eq!(xy[100], format!("{right:.1},60.0"));
        // Events are labelled every 20 along the bottom, bytes every 20 MiB up the side.
        for o in (0..=100).step_by(20) {
            assert!(
                svg.contains(&format!(" text-anchor=\"middle\">{o}</text>")),
                "no tick at {o}"
            );
            assert!(
                svg.contains(&format!(">{o} MiB</text>")),
                "no tick at {o} MiB"
            );
        }
        assert!(!svg.contains(">120 MiB<") && !svg.contains(">120</text>"));
    }

    #[test]
    fn a_title_keeps_only_characters_xml_allows() {
        // A trace's file name may hold control characters; XML 1.0 refuses them even as
        // character references, so an SVG holding one does not open.
        let svg = pool_state(
            &PoolSnapshot {
                source: "sim".into(),
                device: 0,
                device_reserved_bytes: 0,
                total_limit: None,
                kinds: Vec::new(),
            },
            "run\u{1}\u{1b}[0m\u{ffff}.jsonl\t<&>",
        );
        assert!(
            svg.contains(">run\u{fffd}\u{fffd}[0m\u{fffd}.jsonl\t&lt;&amp;&gt;</text>"),
            "{svg}"
        );
        let points = [TimelinePoint::default()];
        for svg in [svg, timeline(&points, "\u{0}\u{8}")] {
            let bad = |c: char| {
                matches!(c, '\u{0}'..='\u{1f}' | '\u{fffe}' | '\u{ffff}') && !"\t\n\r".contains(c)
            };
            assert!(!svg.contains(bad), "{svg:?}");
        }
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(100.0, 5.0), 20.0);
        assert_eq!(tick_step(128.0, 5.0), 50.0);
        assert_eq!(tick_step(7.0, 8.0), 1.0);
    }
}
