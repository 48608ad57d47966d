//! Share descriptors as another process hands them over: a real one, published by a pool over
//! virtual memory on the simulator, then changed field by field, or any JSON at all. Opening
//! one answers with a mapping or a typed error, never a panic. An opened mapping refuses what
//! lies outside the bytes it mapped (anything else would fault here, since the simulator maps
//! real pages). A descriptor left as published reads and writes the exporter's bytes exactly,
//! and translates the exporter's addresses to the right local ones; so does one whose window
//! alone was moved or resized within the same pieces (it opens exactly when the window lies
//! inside them), since it maps the same memory. At the end, with the
//! mapping closed and the pool gone, the simulator holds no reservation, physical memory or
//! mapping.
//!
//! Run it with `-detect_leaks=0`: the simulator's exporter watches each import from a thread
//! of its own, which ends just after the importer lets go, so a leak check right after an
//! input can find that thread still alive. What the target checks instead is what the
//! simulator still holds.
#![no_main]

#[path = "common/sharing.rs"]
mod sharing;

use arbitrary::Arbitrary;
use ascend_pool::region::{DeviceRegion, Region};
use ascend_pool::share::{ShareDescriptor, SharedMapping};
use ascend_pool::source::sim::{SimConfig, SimSource};
use ascend_pool::source::vmm::{VmmConfig, VmmRuntime, VmmSource};
use ascend_pool::{Error, Pool, PoolConfig};
use libfuzzer_sys::fuzz_target;
use sharing::{wind_down, Who, NOTHING_HELD};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
/// Regions the exporter publishes from, at most.
const REGIONS: usize = 4;
/// Operations on an opened mapping, at most.
const MAX_OPS: usize = 64;
/// Bytes at each end of a region that the exporter fills and the shadow knows (filling
/// megabytes per input would cost most of the run).
const KNOWN: u64 = 16 << 10;

/// What the exporter publishes.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Publish {
    /// One region (by index).
    Region(u8),
    /// Everything its source mapped: several extents when a region took a dedicated chunk.
    All,
}

/// One change to the descriptor on its way to the importer.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Change {
    Exporter(i32),
    Base(u64),
    Span(u64),
    Offset(u64),
    Len(u64),
    /// A field moved by a little: the boundaries are where checks go wrong.
    Nudge {
        field: u8,
        by: i16,
    },
    PieceOffset {
        i: u8,
        to: u64,
    },
    PieceLen {
        i: u8,
        to: u64,
    },
    PieceHandle {
        i: u8,
        to: u64,
    },
    SwapHandles {
        i: u8,
        j: u8,
    },
    DropPiece(u8),
    /// A piece repeated right after the last one: the same memory mapped twice.
    RepeatPiece(u8),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum MapOp {
    Read { off: u64, len: u16 },
    Write { off: u64, len: u16, seed: u8 },
    Translate { past: u64 },
}

#[derive(Arbitrary, Debug)]
struct Input {
    /// Region lengths (up to [`REGIONS`]), each at most 3 MiB: those from 1 MiB, half the
    /// 2 MiB chunk, take a dedicated chunk, another extent.
    lens: Vec<u32>,
    publish: Publish,
    who: Who,
    changes: Vec<Change>,
    /// Any text in place of the descriptor's JSON.
    json: Option<String>,
    /// The exporter frees everything before the import: the handles are gone.
    free_before: bool,
    /// The exporter frees everything after the import: the mapping stays valid.
    free_after: bool,
    ops: Vec<MapOp>,
}

fn pattern(region: usize, at: u64) -> u8 {
    (at % 251) as u8 ^ (region as u8).wrapping_mul(97)
}

/// The spans of a region of `len` bytes that the exporter fills: its first and last
/// [`KNOWN`] bytes.
fn known_spans(len: u64) -> [(u64, u64); 2] {
    let n = len.min(KNOWN);
    [(0, n), (len - n, n)]
}

fn piece_index(i: u8, d: &ShareDescriptor) -> Option<usize> {
    (!d.pieces.is_empty()).then(|| usize::from(i) % d.pieces.len())
}

fn change(d: &mut ShareDescriptor, c: Change) {
    match c {
        Change::Exporter(v) => d.exporter = v,
        Change::Base(v) => d.base = v as usize,
        Change::Span(v) => d.span = v,
        Change::Offset(v) => d.offset = v,
        Change::Len(v) => d.len = v,
        Change::Nudge { field, by } => {
            let by = i64::from(by);
            let nudge = |v: u64| v.wrapping_add_signed(by);
            match field % 6 {
                0 => d.span = nudge(d.span),
                1 => d.offset = nudge(d.offset),
                2 => d.len = nudge(d.len),
                3 => d.base = nudge(d.base as u64) as usize,
                4 => {
                    if let Some(p) = d.pieces.last_mut() {
                        p.len = nudge(p.len);
                    }
                }
                _ => {
                    if let Some(p) = d.pieces.first_mut() {
                        p.offset = nudge(p.offset);
                    }
                }
            }
        }
        Change::PieceOffset { i, to } => {
            if let Some(i) = piece_index(i, d) {
                d.pieces[i].offset = to;
            }
        }
        Change::PieceLen { i, to } => {
            if let Some(i) = piece_index(i, d) {
                d.pieces[i].len = to;
            }
        }
        Change::PieceHandle { i, to } => {
            if let Some(i) = piece_index(i, d) {
                d.pieces[i].handle = to;
            }
        }
        Change::SwapHandles { i, j } => {
            if let (Some(i), Some(j)) = (piece_index(i, d), piece_index(j, d)) {
                let h = d.pieces[i].handle;
                d.pieces[i].handle = d.pieces[j].handle;
                d.pieces[j].handle = h;
            }
        }
        Change::DropPiece(i) => {
            if let Some(i) = piece_index(i, d) {
                d.pieces.remove(i);
            }
        }
        Change::RepeatPiece(i) => {
            if let Some(i) = piece_index(i, d) {
                let mut p = d.pieces[i].clone();
                p.offset = d.span;
                d.span = d.span.wrapping_add(p.len);
                d.pieces.push(p);
            }
        }
    }
}

/// What the importer expects at each published byte: the exporter's regions (by their
/// offset from the descriptor's base) with the writes made through the mapping on top.
struct Shadow {
    /// Offset of the window from the base.
    start: u64,
    /// Offset from the base, length and index of each region.
    regions: Vec<(u64, u64, usize)>,
    /// Writes through the mapping, by offset from the base.
    writes: Vec<(u64, Vec<u8>)>,
}

impl Shadow {
    /// Byte `at` of the window.
    fn window_byte(&self, at: u64) -> Option<u8> {
        self.byte(self.start.checked_add(at)?)
    }

    /// The byte `at` bytes from the base.
    fn byte(&self, at: u64) -> Option<u8> {
        for (off, data) in self.writes.iter().rev() {
            if at >= *off && at - off < data.len() as u64 {
                return Some(data[(at - off) as usize]);
            }
        }
        let &(off, len, r) = self
            .regions
            .iter()
            .find(|&&(off, len, _)| at >= off && at - off < len)?;
        let k = at - off;
        known_spans(len)
            .iter()
            .any(|&(from, n)| k >= from && k - from < n)
            .then(|| pattern(r, k))
    }
}

fn exporter_regions(pool: &Pool, lens: &[u32]) -> Vec<DeviceRegion> {
    let mut regions = Vec::new();
    for &l in lens.iter().take(REGIONS) {
        let len = u64::from(l) % (3 * MIB) + 1;
        let Ok(mut r) = pool.alloc_device(len) else {
            continue; // the small device ran out: fine, publish what there is
        };
        let i = regions.len();
        for (from, n) in known_spans(len) {
            let bytes: Vec<u8> = (from..from + n).map(|at| pattern(i, at)).collect();
            pool.copy_from_host(&mut r, from, &bytes).unwrap();
        }
        regions.push(r);
    }
    regions
}

fn run_ops(m: &SharedMapping<SimSource>, ops: &[MapOp], shadow: &mut Option<Shadow>, whole: bool) {
    let len = m.len();
    // Offsets up to 2 MiB past the window (a changed descriptor's length may be anything).
    let reach = len.saturating_add(2 * MIB);
    let inside =
        |off: u64, n: u16| n > 0 && off.checked_add(u64::from(n)).is_some_and(|e| e <= len);
    for &op in ops.iter().take(MAX_OPS) {
        match op {
            MapOp::Read { off, len: n } => {
                let off = off % reach;
                let mut out = vec![0u8; usize::from(n)];
                let r = m.read(off, &mut out);
                let inside = inside(off, n);
                check_outcome(&r, inside, whole, "read");
                if let (Ok(()), Some(s)) = (&r, shadow.as_ref()) {
                    for (k, &b) in out.iter().enumerate() {
                        let at = off + k as u64;
                        if let Some(want) = s.window_byte(at) {
                            assert_eq!(b, want, "byte {at} of the published window");
                        }
                    }
                }
            }
            MapOp::Write { off, len: n, seed } => {
                let off = off % reach;
                let data: Vec<u8> = (0..n).map(|k| seed.wrapping_add(k as u8)).collect();
                let r = m.write(off, &data);
                let inside = inside(off, n);
                check_outcome(&r, inside, whole, "write");
                if let (Ok(()), Some(s)) = (&r, shadow.as_mut()) {
                    s.writes.push((s.start + off, data));
                }
            }
            MapOp::Translate { past } => {
                let d = m.descriptor();
                let k = past % len.saturating_mul(2).saturating_add(1);
                let start = (d.base as u64).checked_add(d.offset);
                let Some(exporter_addr) = start.and_then(|s| s.checked_add(k)) else {
                    continue;
                };
                let want = (k < len).then(|| m.addr() + k as usize);
                let got = m.translate(exporter_addr as usize);
                assert_eq!(got, want, "translate {k} past the start");
            }
        }
    }
}

/// A read or write the published window holds must go through for a descriptor left as
/// published (`whole`: one region as published, no holes; everything published may span
/// holes between chunks, and a changed descriptor may put its window over one, refused as
/// out of bounds); one past the window is refused as out of bounds.
fn check_outcome(r: &ascend_pool::Result<()>, inside: bool, whole: bool, what: &str) {
    match r {
        Ok(()) => assert!(inside, "{what} past the window went through"),
        Err(Error::OutOfBounds { .. }) => assert!(!(inside && whole), "{what} refused: {r:?}"),
        Err(e) => panic!("{what}: {e:?}"),
    }
}

fuzz_target!(|input: Input| {
    let sim = SimConfig::default().with_device_capacity(32 * MIB);
    let sim = Arc::new(SimSource::new(sim).unwrap());
    let vmm = Arc::new(VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default()).unwrap());
    let pool = Pool::new(
        vmm.clone(),
        PoolConfig::default()
            .with_chunk_size(2 * MIB)
            .with_thread_cache(0),
    )
    .unwrap();
    let mut regions = exporter_regions(&pool, &input.lens);
    if regions.is_empty() {
        return;
    }
    let me = sim.bare_tgid().unwrap();
    let access = input.who.access(me);
    let published = match input.publish {
        Publish::Region(i) => {
            let r = &regions[usize::from(i) % regions.len()];
            vmm.publish_region(r, &access).unwrap()
        }
        Publish::All => vmm.publish_all(&access).unwrap(),
    };
    let whole = matches!(input.publish, Publish::Region(_));

    let mut desc = published.clone();
    if let Some(json) = &input.json {
        match ShareDescriptor::from_json(json) {
            Ok(d) => desc = d,
            Err(e) => {
                assert!(matches!(e, Error::Config(_)), "from_json: {e:?}");
                return;
            }
        }
    }
    for &c in &input.changes {
        change(&mut desc, c);
    }
    // Only the window moved (or nothing did): the same memory is mapped, so it opens as the
    // published one does when the window lies in the pieces, and shows the same bytes.
    let same_memory = desc.pieces == published.pieces && desc.span == published.span;
    let window_inside = desc.len > 0
        && desc
            .offset
            .checked_add(desc.len)
            .is_some_and(|e| e <= desc.span);

    if input.free_before {
        regions.clear();
        pool.trim();
    }
    let opened = SharedMapping::open(Arc::clone(&sim), 0, &desc);
    if same_memory && !window_inside {
        assert!(
            matches!(opened, Err(Error::Config(_))),
            "opening a window outside the pieces gave {opened:?}"
        );
    } else if same_memory {
        match (&opened, input.free_before, input.who) {
            (Err(Error::ShareGone { .. }), true, _) => {}
            (Err(Error::ShareRefused { .. }), true, Who::Other) => {}
            (Err(Error::ShareRefused { .. }), false, Who::Other) => {}
            (Ok(_), false, Who::Me | Who::Anyone) => {}
            _ => panic!("opening the published memory gave {opened:?}"),
        }
    } else if let Err(e) = &opened {
        let typed = matches!(
            e,
            Error::Config(_)
                | Error::ShareGone { .. }
                | Error::ShareRefused { .. }
                | Error::Runtime { .. }
                | Error::OutOfMemory { .. }
        );
        assert!(typed, "opening a changed descriptor gave {e:?}");
    }

    if let Ok(m) = opened {
        // What the window should hold, known only when it maps the published memory.
        let mut shadow = same_memory.then(|| Shadow {
            start: desc.offset,
            regions: regions
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    Some((r.addr().checked_sub(published.base)? as u64, r.len(), i))
                })
                .collect(),
            writes: Vec::new(),
        });
        if input.free_after {
            regions.clear();
            pool.trim();
            if let Some(s) = &mut shadow {
                // Freed memory keeps its bytes while imported; only the layout is gone.
                s.regions.clear();
            }
        }
        run_ops(&m, &input.ops, &mut shadow, whole && same_memory);
        // The exporter sees what was written through the mapping.
        if let Some(s) = &shadow {
            for &(off, len, i) in &s.regions {
                for (from, n) in known_spans(len) {
                    let mut back = vec![0u8; n as usize];
                    pool.copy_to_host(&regions[i], from, &mut back).unwrap();
                    for (k, &b) in (from..).zip(&back) {
                        assert_eq!(Some(b), s.byte(off + k), "region {i} byte {k}");
                    }
                }
            }
        }
        m.close().unwrap();
    }

    drop(regions);
    assert_eq!(
        wind_down(pool, vmm, &sim),
        NOTHING_HELD,
        "blocks, reservations, physical memory, mappings left at the simulator"
    );
});
