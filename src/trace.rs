//! Allocation traces: a streaming JSON Lines reader and a replay driver.
//!
//! A trace is one event per line (see `shared/traces/README.md`):
//!
//! ```text
//! {"op":"alloc","id":17,"size":3110400,"mem":"dvpp","align":128}
//! {"op":"free","id":17}
//! ```
//!
//! [`TraceReader`] reads a trace line by line, validates every event against
//! the state of the trace so far (which ids are live, which were freed) and
//! yields either a [`TraceOp`] or a [`Rejection`]. Nothing in a trace makes it
//! panic: bad lines are counted by [`RejectKind`] and reading goes on.
//! The reader also keeps the trace-level statistics that do not depend on any
//! allocator: live and peak requested bytes, live and peak required bytes
//! (the sum of rule-mandated footprints), per memory kind.
//!
//! [`replay`] runs a trace through a [`ReplayerFactory`]: one [`RangeReplayer`]
//! per memory kind, one address range each, carving with the kind's rule (an
//! event's `align` overrides the start alignment). It measures the peak
//! reserved bytes (the sum over kinds of each range's high water) and the time
//! of every allocator call.
//!
//! # Timing
//!
//! Every `alloc` and `free` call on a replayer is timed on its own with a pair
//! of [`std::time::Instant::now`] calls around it; parsing, validation and the
//! driver's own bookkeeping (a hash map from trace id to token) are outside the
//! timed window. Each sample therefore includes one clock read (about 20 ns
//! with the vDSO clock); [`ReplayReport::timer_overhead_ns`] reports the median
//! cost of an empty timed window on the same machine so readers can subtract
//! it. The overhead is the same for every backend, so comparisons are fair.

use std::collections::{HashMap, HashSet};
use std::io::{self, BufRead};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::align::CarveRule;
use crate::kind::MemKind;

/// Default device size: allocations larger than this are rejected as
/// [`RejectKind::SizeTooLarge`], and every replayer range gets this capacity.
pub const DEFAULT_DEVICE_SIZE: u64 = 64 << 30;

/// The longest line a [`TraceReader`] reads, its line end (`\n` or `\r\n`) not counted: an
/// event takes under 200 bytes, and a longer line (a file that is not a trace, a line
/// without its newline) is [`RejectKind::Malformed`] without being held in memory whole.
pub const MAX_LINE: usize = 1 << 20;

/// UTF-8's byte order mark, skipped before a trace's first line.
const BOM: &[u8] = "\u{feff}".as_bytes();

/// Why a trace line was not replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectKind {
    /// Not JSON, not an object, a missing or mistyped field, or an unknown `op`.
    Malformed,
    /// An allocation of 0 bytes.
    ZeroSize,
    /// An allocation larger than the configured device size (or whose footprint overflows).
    SizeTooLarge,
    /// A `mem` that names no memory kind.
    UnknownKind,
    /// An `align` that is not a power of two in `64..=1 GiB`.
    BadAlign,
    /// A free of an id that was never allocated.
    UnknownId,
    /// A free of an id that was already freed.
    DoubleFree,
    /// An allocation reusing an id that is still live.
    IdReused,
    /// The replayer's range could not hold the allocation (reported per backend).
    OutOfMemory,
}

impl RejectKind {
    /// Every category, in report order.
    pub const ALL: [RejectKind; 9] = [
        RejectKind::Malformed,
        RejectKind::ZeroSize,
        RejectKind::SizeTooLarge,
        RejectKind::UnknownKind,
        RejectKind::BadAlign,
        RejectKind::UnknownId,
        RejectKind::DoubleFree,
        RejectKind::IdReused,
        RejectKind::OutOfMemory,
    ];

    /// The snake_case name used in reports and JSON.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::ZeroSize => "zero_size",
            Self::SizeTooLarge => "size_too_large",
            Self::UnknownKind => "unknown_kind",
            Self::BadAlign => "bad_align",
            Self::UnknownId => "unknown_id",
            Self::DoubleFree => "double_free",
            Self::IdReused => "id_reused",
            Self::OutOfMemory => "out_of_memory",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for RejectKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Counts of rejected events by category.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorCounts {
    counts: [u64; RejectKind::ALL.len()],
}

impl ErrorCounts {
    /// Adds one event of category `kind`.
    pub fn add(&mut self, kind: RejectKind) {
        self.counts[kind.index()] += 1;
    }

    /// The count for one category.
    pub fn get(&self, kind: RejectKind) -> u64 {
        self.counts[kind.index()]
    }

    /// The total over all categories.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Adds every count of `other` to `self`.
    pub fn merge(&mut self, other: &ErrorCounts) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
    }

    /// The non-zero categories with their counts, in report order.
    pub fn nonzero(&self) -> impl Iterator<Item = (RejectKind, u64)> + '_ {
        RejectKind::ALL
            .iter()
            .map(|&k| (k, self.get(k)))
            .filter(|&(_, n)| n > 0)
    }
}

impl Serialize for ErrorCounts {
    /// A map from every category name to its count (zeros included), plus `"total"`.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(RejectKind::ALL.len() + 1))?;
        for k in RejectKind::ALL {
            m.serialize_entry(k.name(), &self.get(k))?;
        }
        m.serialize_entry("total", &self.total())?;
        m.end()
    }
}

/// A rejected line: where it was and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rejection {
    /// 1-based line number in the trace.
    pub line: u64,
    /// The category.
    pub kind: RejectKind,
}

/// A valid, validated trace event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceOp {
    /// Allocate `len` bytes of `kind` under `rule`; the trace calls it `id`.
    Alloc {
        /// The trace id (unique while live).
        id: u64,
        /// Bytes requested.
        len: u64,
        /// Memory kind (one range per kind).
        kind: MemKind,
        /// The kind's carve rule with the event's `align` applied.
        rule: CarveRule,
        /// `rule.footprint(len)`.
        footprint: u64,
    },
    /// Free the live allocation `id`.
    Free {
        /// The trace id.
        id: u64,
        /// Memory kind the allocation came from.
        kind: MemKind,
        /// Bytes it requested.
        len: u64,
        /// Its footprint.
        footprint: u64,
    },
}

/// What one line of a trace turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceItem {
    /// A valid event.
    Op(TraceOp),
    /// A line that was counted and skipped.
    Rejected(Rejection),
}

/// Settings for reading a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceConfig {
    /// Largest allocation accepted, and the capacity of every replayer range.
    pub device_size: u64,
    /// [`replay`] only: check every placement the replayer makes against a shadow map of
    /// live segments (alignment, no overlap, inside the range, high water at least the
    /// highest end). Outside the timed window, but it slows the replay and pollutes caches.
    pub check_placement: bool,
    /// [`replay`] only: record [`ReplayReport::timeline`] (live requested, live required and
    /// reserved bytes over the replay). Untimed; costs one look at the backend per event.
    pub timeline: bool,
    /// [`replay`] only: take [`ReplayerFactory::snapshot`] right after this many valid events
    /// (1-based) into [`ReplayReport::snapshot`]. Untimed.
    pub snapshot_at: Option<u64>,
}

impl Default for TraceConfig {
    fn default() -> Self {
        Self {
            device_size: DEFAULT_DEVICE_SIZE,
            check_placement: false,
            timeline: false,
            snapshot_at: None,
        }
    }
}

/// Number of memory kinds a trace can name ([`MemKind::ALL`]).
pub const KIND_COUNT: usize = MemKind::ALL.len();

/// Live and peak byte counts of one memory kind, independent of any allocator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct KindStats {
    /// Valid allocations of this kind.
    pub allocs: u64,
    /// Valid frees of this kind.
    pub frees: u64,
    /// Requested bytes live now.
    pub live_requested: u64,
    /// Footprint bytes live now.
    pub live_required: u64,
    /// Largest `live_requested` ever.
    pub peak_requested: u64,
    /// Largest `live_required` ever: the least memory a rule-obeying allocator needs for this kind.
    pub peak_required: u64,
}

/// The state of an id the reader has seen.
#[derive(Debug, Clone, Copy)]
struct LiveAlloc {
    kind: MemKind,
    len: u64,
    footprint: u64,
}

/// The JSON shape of one line; every field optional so that a missing one is a
/// [`RejectKind::Malformed`] rather than a parse failure of a different kind.
#[derive(Deserialize)]
struct RawEvent<'a> {
    #[serde(borrow)]
    op: std::borrow::Cow<'a, str>,
    id: Option<u64>,
    size: Option<u64>,
    #[serde(borrow)]
    mem: Option<std::borrow::Cow<'a, str>>,
    /// Kept as a number so that a negative or fractional one is a bad alignment.
    align: Option<serde_json::Number>,
}

/// A streaming, validating reader of a JSON Lines trace.
///
/// ```
/// use ascend_pool::trace::{TraceConfig, TraceItem, TraceOp, TraceReader, RejectKind};
/// let text = b"{\"op\":\"alloc\",\"id\":1,\"size\":1,\"mem\":\"host\"}\nnot json\n{\"op\":\"free\",\"id\":1}\n";
/// let mut r = TraceReader::new(&text[..], TraceConfig::default());
/// assert!(matches!(r.next_item().unwrap().unwrap(), TraceItem::Op(TraceOp::Alloc { footprint: 64, .. })));
/// assert!(matches!(r.next_item().unwrap().unwrap(), TraceItem::Rejected(_)));
/// assert!(matches!(r.next_item().unwrap().unwrap(), TraceItem::Op(TraceOp::Free { .. })));
/// assert!(r.next_item().is_none());
/// assert_eq!(r.errors().get(RejectKind::Malformed), 1);
/// ```
#[derive(Debug)]
pub struct TraceReader<R> {
    input: R,
    config: TraceConfig,
    buf: Vec<u8>,
    line: u64,
    bytes_read: u64,
    live: HashMap<u64, LiveAlloc>,
    freed: HashSet<u64>,
    kinds: [KindStats; KIND_COUNT],
    errors: ErrorCounts,
}

impl<R: BufRead> TraceReader<R> {
    /// A reader over `input`.
    pub fn new(input: R, config: TraceConfig) -> Self {
        Self {
            input,
            config,
            buf: Vec::with_capacity(128),
            line: 0,
            bytes_read: 0,
            live: HashMap::new(),
            freed: HashSet::new(),
            kinds: [KindStats::default(); KIND_COUNT],
            errors: ErrorCounts::default(),
        }
    }

    /// The next line's outcome; `None` at the end of the input, `Some(Err)` when
    /// the input itself cannot be read. Blank lines are skipped without a count; a line
    /// longer than [`MAX_LINE`] bytes is [`RejectKind::Malformed`].
    pub fn next_item(&mut self) -> Option<io::Result<TraceItem>> {
        loop {
            self.buf.clear();
            let whole = match self.read_line() {
                Ok((0, _)) => return None,
                Ok((n, whole)) => {
                    self.bytes_read += n as u64;
                    whole
                }
                Err(e) => return Some(Err(e)),
            };
            self.line += 1;
            if whole && self.buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let parsed = if whole {
                self.parse_line()
            } else {
                Err(RejectKind::Malformed)
            };
            let item = match parsed {
                Ok(op) => TraceItem::Op(op),
                Err(kind) => {
                    self.errors.add(kind);
                    TraceItem::Rejected(Rejection {
                        line: self.line,
                        kind,
                    })
                }
            };
            return Some(Ok(item));
        }
    }

    /// Reads the next line, line end included, into `buf`, keeping at most [`MAX_LINE`]
    /// bytes of it, its line end and, on the first line, a byte order mark (which it drops):
    /// returns the bytes the line took from the input (0 at the end) and whether `buf`
    /// holds all of them, and they are at most [`MAX_LINE`] bytes before the line end (so
    /// a CRLF file reads as its LF twin). A read interrupted by a signal is retried.
    fn read_line(&mut self) -> io::Result<(usize, bool)> {
        let (mut taken, mut whole) = (0, true);
        loop {
            let available = match self.input.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if available.is_empty() {
                break;
            }
            let (n, end) = match available.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (available.len(), false),
            };
            let room = MAX_LINE + BOM.len() + 2 - self.buf.len();
            if n > room {
                whole = false;
            }
            self.buf.extend_from_slice(&available[..n.min(room)]);
            self.input.consume(n);
            taken += n;
            if end {
                break;
            }
        }
        let line_end = match self.buf.as_slice() {
            [.., b'\r', b'\n'] => 2,
            [.., b'\n'] => 1,
            _ => 0,
        };
        // A byte order mark some editors write before the first line is no event's.
        if self.line == 0 && self.buf.starts_with(BOM) {
            self.buf.drain(..BOM.len());
        }
        Ok((taken, whole && self.buf.len() - line_end <= MAX_LINE))
    }

    fn parse_line(&mut self) -> Result<TraceOp, RejectKind> {
        // UTF-8 checked for the whole line: `from_slice` lets bytes that are not UTF-8
        // through inside a string it skips (a field the reader does not know).
        let text = std::str::from_utf8(&self.buf).map_err(|_| RejectKind::Malformed)?;
        let raw: RawEvent<'_> = serde_json::from_str(text).map_err(|_| RejectKind::Malformed)?;
        let id = raw.id.ok_or(RejectKind::Malformed)?;
        match raw.op.as_ref() {
            "alloc" => {
                let size = raw.size.ok_or(RejectKind::Malformed)?;
                let mem = raw.mem.ok_or(RejectKind::Malformed)?;
                let align = match raw.align {
                    Some(n) => Some(n.as_u64().ok_or(RejectKind::BadAlign)?),
                    None => None,
                };
                let op = validate_alloc(id, size, &mem, align, &self.config)?;
                let TraceOp::Alloc {
                    kind,
                    len,
                    footprint,
                    ..
                } = op
                else {
                    unreachable!("validate_alloc returns an Alloc")
                };
                if self.live.contains_key(&id) {
                    return Err(RejectKind::IdReused);
                }
                let s = &self.kinds[kind.index()];
                // A kind's live bytes stay within an equal share of `u64::MAX`, so every sum
                // over kinds (live now, peaks) fits too. Only a device size past 2^61 bytes
                // lets a trace get here.
                match s.live_required.checked_add(footprint) {
                    Some(r) if r <= LIVE_BYTES_PER_KIND_MAX => {}
                    _ => return Err(RejectKind::SizeTooLarge),
                }
                self.freed.remove(&id);
                self.live.insert(
                    id,
                    LiveAlloc {
                        kind,
                        len,
                        footprint,
                    },
                );
                let s = &mut self.kinds[kind.index()];
                s.allocs += 1;
                s.live_requested += len;
                s.live_required += footprint;
                s.peak_requested = s.peak_requested.max(s.live_requested);
                s.peak_required = s.peak_required.max(s.live_required);
                Ok(op)
            }
            "free" => match self.live.remove(&id) {
                Some(a) => {
                    self.freed.insert(id);
                    let s = &mut self.kinds[a.kind.index()];
                    s.frees += 1;
                    s.live_requested -= a.len;
                    s.live_required -= a.footprint;
                    Ok(TraceOp::Free {
                        id,
                        kind: a.kind,
                        len: a.len,
                        footprint: a.footprint,
                    })
                }
                None if self.freed.contains(&id) => Err(RejectKind::DoubleFree),
                None => Err(RejectKind::UnknownId),
            },
            _ => Err(RejectKind::Malformed),
        }
    }

    /// Lines read so far (blank ones included).
    pub fn lines(&self) -> u64 {
        self.line
    }

    /// Bytes read so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    /// Rejected lines so far, by category.
    pub fn errors(&self) -> &ErrorCounts {
        &self.errors
    }

    /// Per-kind statistics, indexed like [`MemKind::ALL`].
    pub fn kind_stats(&self) -> &[KindStats; KIND_COUNT] {
        &self.kinds
    }

    /// Allocations still live (leaks at the end of a trace).
    pub fn live_count(&self) -> usize {
        self.live.len()
    }
}

/// Most live bytes (required, hence requested too) one kind may count: a share of
/// `u64::MAX` per kind, so that sums over kinds cannot overflow.
const LIVE_BYTES_PER_KIND_MAX: u64 = u64::MAX / KIND_COUNT as u64;

/// Checks the fields of an allocation event that need no trace state.
fn validate_alloc(
    id: u64,
    size: u64,
    mem: &str,
    align: Option<u64>,
    config: &TraceConfig,
) -> Result<TraceOp, RejectKind> {
    let kind = MemKind::from_trace_name(mem).ok_or(RejectKind::UnknownKind)?;
    if size == 0 {
        return Err(RejectKind::ZeroSize);
    }
    if size > config.device_size {
        return Err(RejectKind::SizeTooLarge);
    }
    let mut rule = kind.carve_rule();
    if let Some(a) = align {
        rule = rule.with_align(a).map_err(|_| RejectKind::BadAlign)?;
    }
    let footprint = rule.footprint(size).map_err(|_| RejectKind::SizeTooLarge)?;
    if footprint > config.device_size {
        return Err(RejectKind::SizeTooLarge);
    }
    Ok(TraceOp::Alloc {
        id,
        len: size,
        kind,
        rule,
        footprint,
    })
}

/// One address range managed by an allocator under test.
///
/// Offsets are relative to the start of the range; the range starts at 0.
///
/// Every backend's `alloc` and `free` are `#[inline]`: the benches and the CLI are other
/// crates, and without it each call crossed a call boundary an application calling the
/// allocator directly does not have, and moved the token through memory (the engine's
/// 32-byte handle most of all: `cargo bench --bench engines` read it 15-38% slower).
pub trait RangeReplayer {
    /// What the replayer needs back to free an allocation.
    type Token;

    /// Carves a segment of `len` bytes under `rule`: `rule.footprint(len)` bytes
    /// starting at an offset aligned to `rule.align()`. `None` when the range is full.
    fn alloc(&mut self, len: u64, rule: CarveRule) -> Option<(u64, Self::Token)>;

    /// Returns a segment from [`alloc`](Self::alloc).
    fn free(&mut self, token: Self::Token);

    /// The highest offset any segment ever reached (end of its footprint): the
    /// bytes this range would have had to reserve from its block source.
    fn high_water(&self) -> u64;

    /// Bytes the range holds from its block source now (for the timeline). A range that
    /// never gives memory back holds its high water.
    fn reserved_now(&self) -> u64 {
        self.high_water()
    }

    /// Calls the range made to allocate from its block source: 1 for a plain range (the
    /// range itself), chunk growth for the pool.
    fn source_alloc_calls(&self) -> u64 {
        1
    }

    /// Calls the range made to give memory back to its block source.
    fn source_free_calls(&self) -> u64 {
        0
    }

    /// Whether [`alloc`](Self::alloc) returns addresses (spread over many blocks) rather
    /// than offsets in one range starting at 0: the placement check then checks alignment
    /// and overlap only, not range bounds or high water.
    fn offsets_are_addresses(&self) -> bool {
        false
    }

    /// The bytes a segment of `len` placed under `rule` takes in this range, for the
    /// placement check: `footprint` (the trace's carve rule) unless the range carves under
    /// another rule (the pool with a padding of its own: `padding:0`, a policy without it).
    fn placed_footprint(&self, len: u64, rule: CarveRule, footprint: u64) -> u64 {
        let _ = (len, rule);
        footprint
    }

    /// Checks the replayer's own invariants; run once at the end of a replay, untimed.
    /// Replayers without a check return `Ok`.
    fn validate(&self) -> Result<(), String> {
        Ok(())
    }
}

/// Builds one [`RangeReplayer`] per memory kind.
pub trait ReplayerFactory {
    /// The range type.
    type Replayer: RangeReplayer;

    /// A short name for reports (`"offset-allocator"`, `"rlsf"`, ...).
    fn name(&self) -> &str;

    /// A range of `capacity` bytes for segments of `kind`.
    fn new_range(&self, kind: MemKind, capacity: u64) -> Result<Self::Replayer, String>;

    /// What the replay measures: `"ranges"` (one range per kind, reserved = high water)
    /// or `"pool"` (the whole pool on a block source, reserved = bytes held from it).
    fn mode(&self) -> &'static str {
        "ranges"
    }

    /// Called by [`replay`] before its first [`new_range`](Self::new_range): a factory whose
    /// ranges share state (the pool) starts afresh here, so every replay is independent.
    fn start_replay(&self) {}

    /// The state of the whole allocator, for [`TraceConfig::snapshot_at`]; `None` when the
    /// backend has no snapshot.
    fn snapshot(&self) -> Option<crate::pool::PoolSnapshot> {
        None
    }
}

/// The shadow model behind [`TraceConfig::check_placement`]: live segments per kind.
#[derive(Debug, Default)]
struct PlacementCheck {
    /// Start -> (end, live segments starting there) per kind: a backend that hands one start
    /// out twice is told once, and freeing one of the two leaves the other checked.
    live: [std::collections::BTreeMap<u64, (u64, u32)>; KIND_COUNT],
    /// Highest end handed out, per kind.
    max_end: [u64; KIND_COUNT],
    /// The first few problems, and how many there were.
    problems: Vec<String>,
    count: u64,
}

impl PlacementCheck {
    const KEEP: usize = 10;

    fn report(&mut self, msg: String) {
        self.count += 1;
        if self.problems.len() < Self::KEEP {
            self.problems.push(msg);
        }
    }

    /// A placement; `capacity` is `None` when offsets are addresses (no range bounds).
    fn alloc(
        &mut self,
        kind: MemKind,
        offset: u64,
        footprint: u64,
        align: u64,
        capacity: Option<u64>,
    ) {
        let k = kind.index();
        let name = kind.trace_name();
        let end = offset.saturating_add(footprint);
        if offset % align != 0 {
            self.report(format!("{name}: offset {offset} is not {align}-aligned"));
        }
        if let Some(capacity) = capacity.filter(|&c| end > c) {
            self.report(format!(
                "{name}: {offset}..{end} passes the capacity {capacity}"
            ));
        }
        let before = self.live[k]
            .range(..=offset)
            .next_back()
            .map(|(&s, &(e, _))| (s, e));
        // Strictly after: a live segment at `offset` itself is `before`, and is said once.
        let after = self.live[k]
            .range((
                std::ops::Bound::Excluded(offset),
                std::ops::Bound::Unbounded,
            ))
            .next()
            .map(|(&s, &(e, _))| (s, e));
        for (s, e) in before.into_iter().chain(after) {
            if s < end && offset < e {
                self.report(format!("{name}: {offset}..{end} overlaps live {s}..{e}"));
            }
        }
        let at = self.live[k].entry(offset).or_insert((end, 0));
        *at = (at.0.max(end), at.1 + 1);
        self.max_end[k] = self.max_end[k].max(end);
    }

    fn free(&mut self, kind: MemKind, offset: u64) {
        let live = &mut self.live[kind.index()];
        if let Some(at) = live.get_mut(&offset) {
            at.1 -= 1;
            if at.1 == 0 {
                live.remove(&offset);
            }
        }
    }

    fn finish<R: RangeReplayer>(mut self, ranges: &[Option<R>; KIND_COUNT]) -> Vec<String> {
        for (k, range) in ranges.iter().enumerate() {
            if range.as_ref().is_some_and(R::offsets_are_addresses) {
                continue;
            }
            let hw = range.as_ref().map_or(0, |r| r.high_water());
            if hw < self.max_end[k] {
                let name = MemKind::ALL[k].trace_name();
                let max = self.max_end[k];
                self.report(format!(
                    "{name}: high water {hw} is below the highest end {max}"
                ));
            }
        }
        if self.count > self.problems.len() as u64 {
            let more = self.count - self.problems.len() as u64;
            self.problems
                .push(format!("... and {more} more placement problems"));
        }
        self.problems
    }
}

/// Per-kind results of a replay.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct KindReport {
    /// The trace name of the kind.
    pub mem: &'static str,
    /// Valid allocations.
    pub allocs: u64,
    /// Valid frees.
    pub frees: u64,
    /// Peak of live requested bytes.
    pub peak_requested_bytes: u64,
    /// Peak of live footprint bytes.
    pub peak_required_bytes: u64,
    /// Peak bytes the kind held from its block source (a range's high water, or the pool's
    /// peak of chunk bytes).
    pub peak_reserved_bytes: u64,
    /// `peak_required / peak_reserved` (0 when nothing was reserved).
    pub utilization: f64,
    /// Block-source allocation calls for this kind.
    pub source_alloc_calls: u64,
    /// Block-source free calls for this kind.
    pub source_free_calls: u64,
}

/// Block-source calls over the replay, and over its warm part.
///
/// The warm part is the second half of the trace: every valid event after the first
/// `ops / 2` ([`warm_from_op`](Self::warm_from_op) on).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SourceCalls {
    /// Allocation calls over the whole replay (the same as [`ReplayReport::backend_alloc_calls`]).
    pub alloc: u64,
    /// Free calls over the whole replay.
    pub free: u64,
    /// 1-based number of the first valid event of the warm part (0 for an empty trace).
    pub warm_from_op: u64,
    /// Valid allocations in the warm part.
    pub warm_allocs: u64,
    /// Allocation calls to the block source in the warm part.
    pub warm_alloc_calls: u64,
    /// `warm_alloc_calls` per 10,000 `warm_allocs` (0 when there were none).
    pub warm_alloc_calls_per_10k_allocs: f64,
}

/// One point of [`ReplayReport::timeline`]: the largest value of each series over a
/// run of events (series peak separately, so a point can combine different moments).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TimelinePoint {
    /// 1-based number of the first valid event of the run.
    pub op: u64,
    /// Live requested bytes, summed over kinds.
    pub requested: u64,
    /// Live rule-mandated footprint bytes, summed over kinds.
    pub required: u64,
    /// Bytes held from block sources, summed over kinds.
    pub reserved: u64,
}

/// Most points a timeline keeps: past it, neighbouring points merge in pairs.
pub const TIMELINE_MAX_POINTS: usize = 2048;

/// A timeline that halves its resolution whenever it fills up, keeping each run's maxima.
#[derive(Debug)]
struct TimelineRecorder {
    points: Vec<TimelinePoint>,
    /// Events per point.
    step: u64,
}

impl TimelineRecorder {
    fn new() -> Self {
        Self {
            points: Vec::with_capacity(TIMELINE_MAX_POINTS),
            step: 1,
        }
    }

    fn record(&mut self, op: u64, requested: u64, required: u64, reserved: u64) {
        let start = (op - 1) / self.step * self.step + 1;
        match self.points.last_mut() {
            Some(p) if p.op == start => {
                p.requested = p.requested.max(requested);
                p.required = p.required.max(required);
                p.reserved = p.reserved.max(reserved);
            }
            _ => {
                if self.points.len() == TIMELINE_MAX_POINTS {
                    self.halve();
                    return self.record(op, requested, required, reserved);
                }
                self.points.push(TimelinePoint {
                    op: start,
                    requested,
                    required,
                    reserved,
                });
            }
        }
    }

    /// Merges neighbours in pairs: each point then covers twice as many events.
    fn halve(&mut self) {
        self.step *= 2;
        let mut merged: Vec<TimelinePoint> = Vec::with_capacity(TIMELINE_MAX_POINTS);
        for p in self.points.drain(..) {
            let start = (p.op - 1) / self.step * self.step + 1;
            match merged.last_mut() {
                Some(m) if m.op == start => {
                    m.requested = m.requested.max(p.requested);
                    m.required = m.required.max(p.required);
                    m.reserved = m.reserved.max(p.reserved);
                }
                _ => merged.push(TimelinePoint { op: start, ..p }),
            }
        }
        self.points = merged;
    }
}

/// Results of replaying one trace through one backend.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// The backend's name.
    pub backend: String,
    /// What was measured: `"pool"` or `"ranges"` ([`ReplayerFactory::mode`]).
    pub mode: &'static str,
    /// Lines read (blank ones included).
    pub lines: u64,
    /// Valid events replayed (allocations plus frees).
    pub ops: u64,
    /// Rejected events by category; `out_of_memory` counts this backend's refusals.
    pub errors: ErrorCounts,
    /// Sum over kinds of the peak requested bytes of each kind.
    pub peak_requested_bytes: u64,
    /// Sum over kinds of the peak footprint bytes of each kind.
    pub peak_required_bytes: u64,
    /// Sum over kinds of each kind's peak reserved bytes.
    pub peak_reserved_bytes: u64,
    /// `peak_required_bytes / peak_reserved_bytes`. The required bytes are the trace's, so
    /// a backend that refused allocations (`errors` counts them as out of memory) can read
    /// above 1: its figure does not compare.
    pub utilization: f64,
    /// Allocation calls to the block source, over every kind: one per range for a plain
    /// range, chunk growth for the pool.
    pub backend_alloc_calls: u64,
    /// Free calls to the block source, over every kind.
    pub backend_free_calls: u64,
    /// Block-source calls in detail, with the warm part of the trace.
    pub source_calls: SourceCalls,
    /// Median time of one timed allocator call, ns (includes one clock read).
    pub ns_per_op_p50: u64,
    /// 99th percentile of the same, ns.
    pub ns_per_op_p99: u64,
    /// Median cost of an empty timed window on this machine, ns.
    pub timer_overhead_ns: u64,
    /// Allocations still live at the end of the trace.
    pub live_at_end: u64,
    /// Per-kind figures, only kinds the trace used.
    pub per_kind: Vec<KindReport>,
    /// Failures of [`RangeReplayer::validate`] at the end of the replay (empty when all hold).
    pub invariant_errors: Vec<String>,
    /// Whether [`TraceConfig::check_placement`] was on: only then do `invariant_errors` also
    /// cover each placement (alignment, overlap, and in ranges mode bounds and high water).
    pub placement_checked: bool,
    /// With [`TraceConfig::timeline`]: live requested / required and reserved bytes over the
    /// replay, at most [`TIMELINE_MAX_POINTS`] points. Not serialised.
    #[serde(skip)]
    pub timeline: Vec<TimelinePoint>,
    /// With [`TraceConfig::snapshot_at`]: the backend's state at that event, if it has one.
    /// Not serialised.
    #[serde(skip)]
    pub snapshot: Option<crate::pool::PoolSnapshot>,
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

/// The `q`-quantile (0..=1) of `samples` by the nearest-rank method; reorders `samples`.
pub fn quantile(samples: &mut [u32], q: f64) -> u64 {
    if samples.is_empty() {
        return 0;
    }
    let n = samples.len();
    let rank = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
    let (_, v, _) = samples.select_nth_unstable(rank);
    u64::from(*v)
}

/// The median cost of an empty timed window (two `Instant::now` calls), ns.
pub fn timer_overhead_ns() -> u64 {
    let mut samples: Vec<u32> = (0..10_000)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(());
            t.elapsed().as_nanos().min(u128::from(u32::MAX)) as u32
        })
        .collect();
    quantile(&mut samples, 0.5)
}

/// The token type of a factory's replayers.
type TokenOf<F> = <<F as ReplayerFactory>::Replayer as RangeReplayer>::Token;

/// Runs a trace through `factory`'s replayers and measures it.
///
/// `progress` is called now and then with the bytes read so far. Returns an
/// error only when the input cannot be read; everything wrong inside the trace
/// is counted in [`ReplayReport::errors`].
pub fn replay<R: BufRead, F: ReplayerFactory>(
    input: R,
    config: TraceConfig,
    factory: &F,
    mut progress: impl FnMut(u64),
) -> io::Result<ReplayReport> {
    factory.start_replay();
    let mut reader = TraceReader::new(input, config);
    let mut ranges: [Option<F::Replayer>; KIND_COUNT] = Default::default();
    // A `None` token: the backend refused the allocation (counted once), so its free is skipped.
    let mut tokens: HashMap<u64, Option<(u64, TokenOf<F>)>> = HashMap::new();
    let mut shadow = config.check_placement.then(PlacementCheck::default);
    let mut timeline = config.timeline.then(TimelineRecorder::new);
    // Reserved bytes per kind after the last event (timeline only).
    let mut reserved_now = [0u64; KIND_COUNT];
    let mut snapshot = None;
    let mut samples: Vec<u32> = Vec::new();
    let mut backend_errors = ErrorCounts::default();
    let mut ops = 0u64;
    // Per valid event, whether it was an allocation; and (event, new source allocation
    // calls) for each event that made some: the warm part is known only at the end.
    let mut op_is_alloc: Vec<bool> = Vec::new();
    let mut call_events: Vec<(u64, u64)> = Vec::new();
    let mut kind_calls = [0u64; KIND_COUNT];

    while let Some(item) = reader.next_item() {
        let TraceItem::Op(op) = item? else { continue };
        ops += 1;
        if ops % 8192 == 0 {
            progress(reader.bytes_read());
        }
        let kind = match op {
            TraceOp::Alloc {
                id,
                len,
                kind,
                rule,
                footprint,
            } => {
                op_is_alloc.push(true);
                let slot = &mut ranges[kind.index()];
                if slot.is_none() {
                    match factory.new_range(kind, config.device_size) {
                        Ok(r) => *slot = Some(r),
                        Err(_) => {
                            backend_errors.add(RejectKind::OutOfMemory);
                            tokens.insert(id, None);
                            continue;
                        }
                    }
                }
                let Some(range) = slot.as_mut() else { continue };
                let t = Instant::now();
                let got = range.alloc(len, rule);
                let ns = t.elapsed().as_nanos();
                samples.push(ns.min(u128::from(u32::MAX)) as u32);
                match (got.as_ref(), shadow.as_mut()) {
                    (None, _) => backend_errors.add(RejectKind::OutOfMemory),
                    (Some(&(offset, _)), Some(check)) => {
                        let capacity =
                            (!range.offsets_are_addresses()).then_some(config.device_size);
                        let placed = range.placed_footprint(len, rule, footprint);
                        check.alloc(kind, offset, placed, rule.align(), capacity)
                    }
                    (Some(_), None) => {}
                }
                tokens.insert(id, got);
                kind
            }
            TraceOp::Free { id, kind, .. } => {
                op_is_alloc.push(false);
                if let Some(Some((offset, token))) = tokens.remove(&id) {
                    if let Some(check) = shadow.as_mut() {
                        check.free(kind, offset);
                    }
                    if let Some(range) = ranges[kind.index()].as_mut() {
                        let t = Instant::now();
                        range.free(token);
                        let ns = t.elapsed().as_nanos();
                        samples.push(ns.min(u128::from(u32::MAX)) as u32);
                    }
                }
                kind
            }
        };
        if let Some(tl) = timeline.as_mut() {
            // Every kind, not only the event's: a device kind the source refused takes back
            // what the other device kinds hold idle (the pool's release of idle memory).
            for (now, range) in reserved_now.iter_mut().zip(ranges.iter()) {
                *now = range.as_ref().map_or(0, RangeReplayer::reserved_now);
            }
            let live = reader.kind_stats();
            tl.record(
                ops,
                live.iter().map(|s| s.live_requested).sum(),
                live.iter().map(|s| s.live_required).sum(),
                reserved_now.iter().sum(),
            );
        }
        if config.snapshot_at == Some(ops) {
            snapshot = factory.snapshot();
        }
        let k = kind.index();
        let calls = ranges[k]
            .as_ref()
            .map_or(0, RangeReplayer::source_alloc_calls);
        if calls != kind_calls[k] {
            call_events.push((ops, calls.saturating_sub(kind_calls[k])));
            kind_calls[k] = calls;
        }
    }
    progress(reader.bytes_read());

    let mut errors = *reader.errors();
    errors.merge(&backend_errors);
    let mut invariant_errors = Vec::new();
    if let Some(check) = shadow {
        invariant_errors.extend(check.finish(&ranges));
    }
    for (kind, range) in MemKind::ALL.iter().zip(ranges.iter()) {
        if let Some(Err(e)) = range.as_ref().map(RangeReplayer::validate) {
            invariant_errors.push(format!("{}: {e}", kind.trace_name()));
        }
    }
    let mut per_kind = Vec::new();
    let (mut req, mut need, mut res) = (0u64, 0u64, 0u64);
    let (mut alloc_total, mut free_total) = (0u64, 0u64);
    for (i, kind) in MemKind::ALL.iter().enumerate() {
        let s = reader.kind_stats()[i];
        let range = ranges[i].as_ref();
        let reserved = range.map_or(0, RangeReplayer::high_water);
        let (a, f) = range.map_or((0, 0), |r| (r.source_alloc_calls(), r.source_free_calls()));
        alloc_total += a;
        free_total += f;
        if s.allocs == 0 && reserved == 0 {
            continue;
        }
        req += s.peak_requested;
        need += s.peak_required;
        res += reserved;
        per_kind.push(KindReport {
            mem: kind.trace_name(),
            allocs: s.allocs,
            frees: s.frees,
            peak_requested_bytes: s.peak_requested,
            peak_required_bytes: s.peak_required,
            peak_reserved_bytes: reserved,
            utilization: ratio(s.peak_required, reserved),
            source_alloc_calls: a,
            source_free_calls: f,
        });
    }
    // The warm part: every event after the first half.
    let half = ops / 2;
    let warm_allocs = op_is_alloc[half as usize..].iter().filter(|&&a| a).count() as u64;
    let warm_alloc_calls = call_events
        .iter()
        .filter(|&&(op, _)| op > half)
        .map(|&(_, n)| n)
        .sum::<u64>();
    let source_calls = SourceCalls {
        alloc: alloc_total,
        free: free_total,
        warm_from_op: if ops == 0 { 0 } else { half + 1 },
        warm_allocs,
        warm_alloc_calls,
        warm_alloc_calls_per_10k_allocs: ratio(warm_alloc_calls * 10_000, warm_allocs),
    };
    // Segments the trace never freed go back now, after measuring, so that a backend
    // ends empty (the pool would otherwise report them as leaks when it drops).
    for (id, entry) in tokens.drain() {
        let (Some((_, token)), Some(live)) = (entry, reader.live.get(&id)) else {
            continue;
        };
        if let Some(range) = ranges[live.kind.index()].as_mut() {
            range.free(token);
        }
    }
    let p50 = quantile(&mut samples, 0.5);
    let p99 = quantile(&mut samples, 0.99);
    Ok(ReplayReport {
        backend: factory.name().to_owned(),
        mode: factory.mode(),
        lines: reader.lines(),
        ops,
        errors,
        peak_requested_bytes: req,
        peak_required_bytes: need,
        peak_reserved_bytes: res,
        utilization: ratio(need, res),
        backend_alloc_calls: alloc_total,
        backend_free_calls: free_total,
        source_calls,
        ns_per_op_p50: p50,
        ns_per_op_p99: p99,
        timer_overhead_ns: timer_overhead_ns(),
        live_at_end: reader.live_count() as u64,
        per_kind,
        invariant_errors,
        placement_checked: config.check_placement,
        timeline: timeline.map_or_else(Vec::new, |t| t.points),
        snapshot,
    })
}

/// The 1-based number of the valid event after which the live footprint bytes, summed
/// over kinds, first reach their largest value: the fullest moment of the trace, where
/// `replay --svg-state` takes its snapshot. `None` for a trace without valid events.
pub fn fullest_op<R: BufRead>(input: R, config: TraceConfig) -> io::Result<Option<u64>> {
    let mut reader = TraceReader::new(input, config);
    let (mut ops, mut best, mut at) = (0u64, 0u64, None);
    while let Some(item) = reader.next_item() {
        if let TraceItem::Op(op) = item? {
            ops += 1;
            if matches!(op, TraceOp::Alloc { .. }) {
                let live: u64 = reader.kind_stats().iter().map(|s| s.live_required).sum();
                if live > best {
                    best = live;
                    at = Some(ops);
                }
            }
        }
    }
    Ok(at)
}

/// Our [`CarveEngine`](crate::engine::CarveEngine) behind [`RangeReplayer`]: one engine per range.
#[derive(Debug)]
pub struct EngineReplayer {
    engine: crate::engine::CarveEngine,
    /// Frees the engine refused (never expected: the driver frees each handle once).
    refused_frees: u64,
}

impl EngineReplayer {
    /// The engine inside.
    pub fn engine(&self) -> &crate::engine::CarveEngine {
        &self.engine
    }
}

impl RangeReplayer for EngineReplayer {
    type Token = crate::engine::Allocation;

    #[inline]
    fn alloc(&mut self, len: u64, rule: CarveRule) -> Option<(u64, Self::Token)> {
        let a = self.engine.alloc(len, rule).ok()?;
        Some((a.offset(), a))
    }

    #[inline]
    fn free(&mut self, token: Self::Token) {
        if self.engine.free(token).is_err() {
            self.refused_frees += 1;
        }
    }

    fn high_water(&self) -> u64 {
        self.engine.high_water()
    }

    fn validate(&self) -> Result<(), String> {
        if self.refused_frees > 0 {
            return Err(format!("{} frees were refused", self.refused_frees));
        }
        self.engine.validate().map_err(|e| e.to_string())
    }
}

/// Builds [`EngineReplayer`]s with one [`EngineConfig`](crate::engine::EngineConfig).
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineFactory {
    /// The configuration of every engine.
    pub config: crate::engine::EngineConfig,
}

impl ReplayerFactory for EngineFactory {
    type Replayer = EngineReplayer;

    fn name(&self) -> &str {
        match self.config.range {
            crate::engine::RangeTier::Tlsf => "ascend-pool",
            crate::engine::RangeTier::Buddy => "ascend-pool (buddy tier)",
        }
    }

    /// A range of `capacity` bytes, or of the most the engine's range tier spans
    /// ([`RangeTier::max_capacity`](crate::engine::RangeTier::max_capacity)) when that is less.
    fn new_range(&self, _kind: MemKind, capacity: u64) -> Result<EngineReplayer, String> {
        // The engine counts in 64-byte units, and spans a bounded number of them.
        let capacity = capacity.min(self.config.range.max_capacity());
        let capacity = capacity / crate::align::DEFAULT_ALIGN * crate::align::DEFAULT_ALIGN;
        let engine =
            crate::engine::CarveEngine::new(capacity, self.config).map_err(|e| e.to_string())?;
        Ok(EngineReplayer {
            engine,
            refused_frees: 0,
        })
    }
}

/// Our engine as any thread-safe pool must at least wrap it: behind a mutex, with every live
/// segment holding a counted handle on the engine (as a pool region holds its pool).
///
/// Not a backend users would run: a floor, the time an uncontended lock and one reference
/// count per call add to [`EngineReplayer`], for reading the pool's time per operation
/// against the peers', which take neither.
#[derive(Debug)]
pub struct LockedEngineReplayer(std::sync::Arc<std::sync::Mutex<EngineReplayer>>);

/// A segment of a [`LockedEngineReplayer`]: the engine's handle and a counted handle on the engine.
#[derive(Debug, Clone)]
pub struct LockedSegment(
    crate::engine::Allocation,
    std::sync::Arc<std::sync::Mutex<EngineReplayer>>,
);

impl LockedEngineReplayer {
    fn engine(&self) -> std::sync::MutexGuard<'_, EngineReplayer> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl RangeReplayer for LockedEngineReplayer {
    type Token = LockedSegment;

    #[inline]
    fn alloc(&mut self, len: u64, rule: CarveRule) -> Option<(u64, LockedSegment)> {
        let (offset, a) = self.engine().alloc(len, rule)?;
        Some((offset, LockedSegment(a, std::sync::Arc::clone(&self.0))))
    }

    #[inline]
    fn free(&mut self, token: LockedSegment) {
        let LockedSegment(a, owner) = token;
        owner.lock().unwrap_or_else(|p| p.into_inner()).free(a);
    }

    fn high_water(&self) -> u64 {
        self.engine().high_water()
    }

    fn validate(&self) -> Result<(), String> {
        self.engine().validate()
    }
}

/// Builds [`LockedEngineReplayer`]s, each over an engine its [`EngineFactory`] makes.
#[derive(Debug, Clone, Copy, Default)]
pub struct LockedEngineFactory(pub EngineFactory);

impl ReplayerFactory for LockedEngineFactory {
    type Replayer = LockedEngineReplayer;

    fn name(&self) -> &str {
        "ascend-pool (locked)"
    }

    fn new_range(&self, kind: MemKind, capacity: u64) -> Result<LockedEngineReplayer, String> {
        let inner = self.0.new_range(kind, capacity)?;
        Ok(LockedEngineReplayer(std::sync::Arc::new(
            std::sync::Mutex::new(inner),
        )))
    }
}

/// A segment the pool carved during a replay: an opaque handle for [`PoolRange::free`],
/// which takes it, so it is freed once. Not `Clone`: a copy freed again would reach a
/// thread cache or a shape slot, which do not check for a second free (two later
/// allocations would share the segment).
///
/// ```compile_fail
/// use ascend_pool::trace::{PoolFactory, RangeReplayer, ReplayerFactory};
/// use ascend_pool::{CarveRule, MemKind, PoolConfig};
/// let factory = PoolFactory::new(PoolConfig::default(), 1 << 30).unwrap();
/// factory.start_replay();
/// let mut range = factory.new_range(MemKind::Dvpp, 1 << 30).unwrap();
/// let (_, token) = range.alloc(1 << 20, CarveRule::new(32, 128).unwrap()).unwrap();
/// range.free(token.clone());
/// ```
#[derive(Debug)]
pub struct PoolSegment(crate::pool::OwnedSegment);

/// One replay's pool and the simulator under it.
#[derive(Debug)]
struct PoolSession {
    pool: crate::pool::Pool,
    sim: std::sync::Arc<crate::source::sim::SimSource>,
    /// The virtual-memory source between pool and simulator, in [`ReplaySource::Vmm`].
    vmm: Option<std::sync::Arc<crate::source::vmm::VmmSource<crate::source::sim::SimSource>>>,
}

/// Where a [`PoolFactory`]'s pool takes its blocks from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplaySource {
    /// Device memory from virtual memory on the simulator
    /// ([`VmmSource`](crate::source::vmm::VmmSource)): a chunk grows in place, granule by
    /// granule, so one range per kind serves the whole trace. DVPP and host memory, which
    /// the runtime cannot map, come straight from the simulator.
    #[default]
    Vmm,
    /// Every block from the simulator's `aclrtMalloc*` calls: fixed chunks.
    Sim,
}

impl ReplaySource {
    /// `"vmm"` or `"sim"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Vmm => "vmm",
            Self::Sim => "sim",
        }
    }
}

/// One memory kind of a [`PoolFactory`]'s pool behind [`RangeReplayer`].
///
/// Allocations go through the pool's own raw path (the allocation and release its typed
/// regions use): chunked growth from the simulator, dedicated chunks for large
/// requests, the release threshold, and the pool's statistics, everything but the typed
/// region wrapper. Returned offsets are addresses.
#[derive(Debug)]
pub struct PoolRange {
    session: std::rc::Rc<PoolSession>,
    kind: MemKind,
    /// Frees the pool refused (never expected: the driver frees each handle once).
    refused_frees: u64,
}

impl RangeReplayer for PoolRange {
    type Token = PoolSegment;

    #[inline]
    fn alloc(&mut self, len: u64, rule: CarveRule) -> Option<(u64, PoolSegment)> {
        match self.session.pool.alloc_raw(self.kind, len, rule.align()) {
            Ok(s) => Some((s.raw.addr as u64, PoolSegment(s))),
            Err(_) => None,
        }
    }

    #[inline]
    fn free(&mut self, token: PoolSegment) {
        if crate::pool::PoolInner::release(token.0.owner, &token.0.raw, &[]).is_err() {
            self.refused_frees += 1;
        }
    }

    /// The kind's peak of bytes held from the simulator (chunks, dedicated ones included).
    fn high_water(&self) -> u64 {
        self.session.pool.stats(self.kind).peak_reserved_bytes
    }

    fn reserved_now(&self) -> u64 {
        self.session.pool.stats(self.kind).reserved_bytes
    }

    /// The pool's count ([`validate`](RangeReplayer::validate) checks it against the simulator's).
    fn source_alloc_calls(&self) -> u64 {
        self.session.pool.source_alloc_calls(self.kind)
    }

    /// The pool's count (the simulator shares `aclrtFree` between three kinds).
    fn source_free_calls(&self) -> u64 {
        self.session.pool.stats(self.kind).source_free_calls
    }

    fn offsets_are_addresses(&self) -> bool {
        true
    }

    /// The pool carves under its own padding (`padding`, none for a policy without it).
    fn placed_footprint(&self, len: u64, rule: CarveRule, footprint: u64) -> u64 {
        self.session
            .pool
            .inner
            .rule(self.kind, rule.align())
            .and_then(|r| Ok(r.footprint(len)?))
            .unwrap_or(footprint)
    }

    /// The pool's full check, and its call counter against the simulator's.
    fn validate(&self) -> Result<(), String> {
        if self.refused_frees > 0 {
            return Err(format!("{} frees were refused", self.refused_frees));
        }
        self.session.pool.validate().map_err(|e| e.to_string())?;
        let pool_calls = self.source_alloc_calls();
        let Some(vmm) = &self.session.vmm else {
            let sim_calls = self.session.sim.stats().alloc_calls(self.kind);
            if pool_calls != sim_calls {
                return Err(format!(
                    "the pool counted {pool_calls} source allocations, the simulator {sim_calls}"
                ));
            }
            return Ok(());
        };
        vmm.validate().map_err(|e| e.to_string())?;
        // Device kinds are mapped by the virtual-memory source: what the pool holds of them
        // is exactly what is mapped (chunks are whole granules).
        let held: u64 = self
            .session
            .pool
            .all_stats()
            .iter()
            .filter(|s| crate::source::vmm::is_virtual(s.kind))
            .map(|s| s.reserved_bytes)
            .sum();
        let mapped = vmm.stats().mapped_bytes;
        if held != mapped {
            return Err(format!(
                "the pool holds {held} bytes of device memory, the virtual-memory source maps {mapped}"
            ));
        }
        Ok(())
    }
}

/// Builds [`PoolRange`]s: a fresh [`Pool`](crate::pool::Pool) over a fresh
/// [`SimSource`](crate::source::sim::SimSource) for every replay, shared by its kinds.
///
/// The simulator gets `device_size` bytes of device and of pinned host memory (DVPP keeps
/// its 16 GiB address limit). The pool's `record` option is ignored: a replay never records.
#[derive(Debug)]
pub struct PoolFactory {
    pool_config: crate::pool::PoolConfig,
    sim_config: crate::source::sim::SimConfig,
    source: ReplaySource,
    session: std::cell::RefCell<Option<std::rc::Rc<PoolSession>>>,
}

impl PoolFactory {
    /// A factory for pools configured by `pool_config` over a simulator of `device_size` bytes.
    pub fn new(pool_config: crate::pool::PoolConfig, device_size: u64) -> crate::Result<Self> {
        let pool_config = crate::pool::PoolConfig {
            record: None,
            ..pool_config
        };
        pool_config.validate()?;
        let sim_config = crate::source::sim::SimConfig::default()
            .with_device_capacity(device_size)
            .with_host_capacity(device_size);
        // Fails on a zero size, like the replay itself would.
        crate::source::sim::SimSource::new(sim_config.clone())?;
        Ok(Self {
            pool_config,
            sim_config,
            source: ReplaySource::default(),
            session: std::cell::RefCell::new(None),
        })
    }

    /// Takes blocks from `source` (default [`ReplaySource::Vmm`]).
    pub fn with_source(mut self, source: ReplaySource) -> Self {
        self.source = source;
        self
    }

    /// Where the pool takes its blocks from.
    pub fn source(&self) -> ReplaySource {
        self.source
    }

    /// The pool configuration every replay uses.
    pub fn pool_config(&self) -> &crate::pool::PoolConfig {
        &self.pool_config
    }

    /// Builds a pool as a replay would and allocates one byte of device memory from it: a
    /// configuration the source cannot serve (a device it does not have) fails here, before
    /// any replay, instead of failing every event of one.
    pub fn check(&self) -> crate::Result<()> {
        let session = self.session()?;
        drop(session.pool.alloc_device(1)?);
        Ok(())
    }

    /// A fresh simulator, its virtual-memory source if asked for, and a pool over them.
    fn session(&self) -> crate::Result<PoolSession> {
        let sim = std::sync::Arc::new(crate::source::sim::SimSource::new(self.sim_config.clone())?);
        let (source, vmm): (std::sync::Arc<dyn crate::source::BlockSource>, _) = match self.source {
            ReplaySource::Sim => (sim.clone(), None),
            ReplaySource::Vmm => {
                let vmm = std::sync::Arc::new(crate::source::vmm::VmmSource::new(
                    sim.clone(),
                    self.pool_config.device,
                    crate::source::vmm::VmmConfig::default(),
                )?);
                (vmm.clone(), Some(vmm))
            }
        };
        let pool = crate::pool::Pool::new(source, self.pool_config.clone())?;
        Ok(PoolSession { pool, sim, vmm })
    }
}

impl ReplayerFactory for PoolFactory {
    type Replayer = PoolRange;

    fn name(&self) -> &str {
        "ascend-pool"
    }

    fn mode(&self) -> &'static str {
        "pool"
    }

    fn start_replay(&self) {
        // The last replay's pool and simulator go first: a new session next to them would
        // hold two reservations of virtual addresses at once (4x the device each), more than
        // the address space has for the largest device sizes, and refuse every event.
        *self.session.borrow_mut() = None;
        *self.session.borrow_mut() = self.session().ok().map(std::rc::Rc::new);
    }

    fn new_range(&self, kind: MemKind, _capacity: u64) -> Result<PoolRange, String> {
        let session = self
            .session
            .borrow()
            .clone()
            .ok_or("the pool could not be created")?;
        Ok(PoolRange {
            session,
            kind,
            refused_frees: 0,
        })
    }

    fn snapshot(&self) -> Option<crate::pool::PoolSnapshot> {
        self.session.borrow().as_ref().map(|s| s.pool.snapshot())
    }
}

/// A reference replayer for tests: a bump pointer that never reuses memory.
///
/// Its high water is the sum of all footprints ever allocated (plus alignment gaps),
/// which makes its numbers easy to check by hand.
#[derive(Debug, Clone, Default)]
pub struct BumpReplayer {
    next: u64,
}

impl RangeReplayer for BumpReplayer {
    type Token = ();

    #[inline]
    fn alloc(&mut self, len: u64, rule: CarveRule) -> Option<(u64, ())> {
        let start = crate::align::align_up(self.next, rule.align())?;
        let end = start.checked_add(rule.footprint(len).ok()?)?;
        self.next = end;
        Some((start, ()))
    }

    fn free(&mut self, _token: ()) {}

    fn high_water(&self) -> u64 {
        self.next
    }
}

/// Builds [`BumpReplayer`]s.
#[derive(Debug, Clone, Copy, Default)]
pub struct BumpFactory;

impl ReplayerFactory for BumpFactory {
    type Replayer = BumpReplayer;

    fn name(&self) -> &str {
        "bump"
    }

    fn new_range(&self, _kind: MemKind, _capacity: u64) -> Result<BumpReplayer, String> {
        Ok(BumpReplayer::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(text: &str) -> (Vec<TraceItem>, ErrorCounts) {
        let mut r = TraceReader::new(text.as_bytes(), TraceConfig::default());
        let mut items = Vec::new();
        while let Some(i) = r.next_item() {
            items.push(i.unwrap());
        }
        (items, *r.errors())
    }

    fn rejected(text: &str) -> RejectKind {
        let (items, _) = read_all(text);
        match items.last() {
            Some(TraceItem::Rejected(r)) => r.kind,
            other => panic!("expected a rejection, got {other:?}"),
        }
    }

    #[test]
    fn each_category() {
        let a = r#"{"op":"alloc","id":1,"size":10,"mem":"device"}"#;
        assert_eq!(rejected("{"), RejectKind::Malformed);
        assert_eq!(rejected("[1,2]"), RejectKind::Malformed);
        assert_eq!(
            rejected(r#"{"op":"alloc","id":1,"mem":"device"}"#),
            RejectKind::Malformed
        );
        assert_eq!(
            rejected(r#"{"op":"alloc","id":-1,"size":1,"mem":"device"}"#),
            RejectKind::Malformed
        );
        assert_eq!(rejected(r#"{"op":"move","id":1}"#), RejectKind::Malformed);
        assert_eq!(
            rejected(r#"{"op":"alloc","id":1,"size":0,"mem":"device"}"#),
            RejectKind::ZeroSize
        );
        assert_eq!(
            rejected(r#"{"op":"alloc","id":1,"size":68719476737,"mem":"device"}"#),
            RejectKind::SizeTooLarge
        );
        assert_eq!(
            rejected(r#"{"op":"alloc","id":1,"size":1,"mem":"hbm"}"#),
            RejectKind::UnknownKind
        );
        for bad in ["0", "32", "96", "2147483648", "-64", "64.5"] {
            let line = format!(r#"{{"op":"alloc","id":1,"size":1,"mem":"host","align":{bad}}}"#);
            assert_eq!(rejected(&line), RejectKind::BadAlign, "align {bad}");
        }
        assert_eq!(rejected(r#"{"op":"free","id":9}"#), RejectKind::UnknownId);
        assert_eq!(
            rejected(&format!(
                "{a}\n{{\"op\":\"free\",\"id\":1}}\n{{\"op\":\"free\",\"id\":1}}"
            )),
            RejectKind::DoubleFree
        );
        assert_eq!(rejected(&format!("{a}\n{a}")), RejectKind::IdReused);
    }

    #[test]
    fn ids_may_be_reused_after_free_and_blank_lines_are_skipped() {
        let text = "{\"op\":\"alloc\",\"id\":1,\"size\":1,\"mem\":\"host\"}\n\n  \n\
                    {\"op\":\"free\",\"id\":1}\n{\"op\":\"alloc\",\"id\":1,\"size\":1,\"mem\":\"host\"}";
        let (items, errors) = read_all(text);
        assert_eq!(items.len(), 3);
        assert_eq!(errors.total(), 0);
    }

    #[test]
    fn invalid_utf8_is_malformed_not_fatal() {
        let bytes: &[u8] = b"\xff\xfe\n{\"op\":\"free\",\"id\":3}\n";
        let mut r = TraceReader::new(bytes, TraceConfig::default());
        while let Some(i) = r.next_item() {
            i.unwrap();
        }
        assert_eq!(r.errors().get(RejectKind::Malformed), 1);
        assert_eq!(r.errors().get(RejectKind::UnknownId), 1);
    }

    /// The reader's own counts: lines (blank ones too), bytes, and per kind the valid
    /// events and live and peak bytes; the rejections by category, as listed and as JSON.
    #[test]
    fn the_reader_counts_lines_bytes_events_and_rejections() {
        let text = r#"{"op":"alloc","id":1,"size":100,"mem":"device"}

{"op":"alloc","id":2,"size":10,"mem":"host"}
{"op":"free","id":1}
not json
{"op":"free","id":7}
{"op":"free","id":8}
{"op":"alloc","id":3,"size":1,"mem":"device"}
"#;
        let mut r = TraceReader::new(text.as_bytes(), TraceConfig::default());
        while let Some(i) = r.next_item() {
            i.unwrap();
        }
        assert_eq!((r.lines(), r.bytes_read()), (8, text.len() as u64));
        assert_eq!(r.live_count(), 2);
        let device = r.kind_stats()[MemKind::DEVICE.index()];
        assert_eq!(
            device,
            KindStats {
                allocs: 2,
                frees: 1,
                live_requested: 1,
                live_required: 64,
                peak_requested: 100,
                peak_required: 192,
            }
        );
        let host = r.kind_stats()[MemKind::Host.index()];
        assert_eq!((host.allocs, host.frees, host.live_required), (1, 0, 64));
        let errors = *r.errors();
        assert_eq!(
            errors.nonzero().collect::<Vec<_>>(),
            [(RejectKind::Malformed, 1), (RejectKind::UnknownId, 2)]
        );
        let json = serde_json::to_value(errors).unwrap();
        assert_eq!(json.as_object().unwrap().len(), RejectKind::ALL.len() + 1);
        assert_eq!(
            (json["unknown_id"].as_u64(), json["total"].as_u64()),
            (Some(2), Some(3))
        );
        assert_eq!(json["double_free"].as_u64(), Some(0));
        // A backend's rejections add to the reader's.
        let mut all = errors;
        let mut backend = ErrorCounts::default();
        backend.add(RejectKind::OutOfMemory);
        backend.add(RejectKind::UnknownId);
        all.merge(&backend);
        assert_eq!(
            all.nonzero().collect::<Vec<_>>(),
            [
                (RejectKind::Malformed, 1),
                (RejectKind::UnknownId, 3),
                (RejectKind::OutOfMemory, 1)
            ]
        );
        for k in RejectKind::ALL {
            assert_eq!(k.to_string(), k.name());
        }
    }

    /// An allocation fits the device when its footprint does, up to the last byte.
    #[test]
    fn a_footprint_of_exactly_the_device_size_fits() {
        let config = TraceConfig {
            device_size: 1 << 20,
            ..TraceConfig::default()
        };
        let host = |size: u64| validate_alloc(1, size, "host", None, &config);
        assert!(
            matches!(host((1 << 20) - 32), Ok(TraceOp::Alloc { footprint, .. }) if footprint == 1 << 20)
        );
        for size in [(1 << 20) - 31, 1 << 20, (1 << 20) + 1] {
            assert_eq!(host(size), Err(RejectKind::SizeTooLarge), "{size}");
        }
    }

    /// A line longer than `MAX_LINE` is malformed, read past without being held whole, and
    /// the lines after it are read as usual; one of exactly `MAX_LINE` bytes is read whole,
    /// with either line end or none.
    #[test]
    fn an_overlong_line_is_malformed_and_reading_goes_on() {
        let event = r#"{"op":"alloc","id":1,"size":1,"mem":"host"}"#;
        let padded = |len: usize| format!("{event}{}\n", " ".repeat(len - event.len() - 1));
        let text = format!(
            "{}{}\n{}{}",
            padded(MAX_LINE),
            "x".repeat(3 * MAX_LINE + 5),
            padded(MAX_LINE + 2).replace("\"id\":1", "\"id\":2"),
            "y".repeat(MAX_LINE + 1),
        );
        // Small reads, so that a line spans many of them.
        let input = io::BufReader::with_capacity(4096, text.as_bytes());
        let mut r = TraceReader::new(input, TraceConfig::default());
        let mut items = Vec::new();
        while let Some(i) = r.next_item() {
            items.push(match i.unwrap() {
                TraceItem::Op(TraceOp::Alloc { id, .. } | TraceOp::Free { id, .. }) => Ok(id),
                TraceItem::Rejected(j) => Err((j.line, j.kind)),
            });
        }
        assert_eq!(
            items,
            [
                Ok(1),
                Err((2, RejectKind::Malformed)),
                Err((3, RejectKind::Malformed)),
                Err((4, RejectKind::Malformed)),
            ]
        );
        assert_eq!(r.lines(), 4);
        assert_eq!(r.bytes_read(), text.len() as u64);
        assert!(r.buf.len() <= MAX_LINE + BOM.len() + 2);
    }

    /// A byte order mark before the first line is skipped; anywhere else it is malformed.
    #[test]
    fn a_byte_order_mark_starts_a_trace() {
        let event = |id: u32| format!(r#"{{"op":"alloc","id":{id},"size":10,"mem":"host"}}"#);
        let read = |text: String| {
            let mut r = TraceReader::new(text.as_bytes(), TraceConfig::default());
            let mut ops = 0;
            while let Some(i) = r.next_item() {
                ops += u32::from(matches!(i.unwrap(), TraceItem::Op(_)));
            }
            (ops, r.errors().get(RejectKind::Malformed))
        };
        assert_eq!(
            read(format!("\u{feff}{}\n\u{feff}{}\n", event(1), event(2))),
            (1, 1)
        );
        // Before a blank first line too, which is skipped as any blank line is; and it is
        // not part of the line's length.
        assert_eq!(read(format!("\u{feff}\n{}\n", event(1))), (1, 0));
        let long = format!("{}{}", event(1), " ".repeat(MAX_LINE - event(1).len()));
        assert_eq!(read(format!("\u{feff}{long}\n")), (1, 0));
    }

    /// The line end is not part of the line's length: `MAX_LINE` bytes of event are read
    /// whole before `\n`, before `\r\n` and at the end of the input, one byte more in none.
    #[test]
    fn the_line_limit_leaves_the_line_end_out() {
        let event = r#"{"op":"alloc","id":1,"size":10,"mem":"host"}"#;
        let line = |len: usize| format!("{event}{}", " ".repeat(len - event.len()));
        let malformed = |text: String| {
            let mut r = TraceReader::new(text.as_bytes(), TraceConfig::default());
            while let Some(i) = r.next_item() {
                i.unwrap();
            }
            r.errors().get(RejectKind::Malformed)
        };
        for end in ["", "\n", "\r\n"] {
            assert_eq!(malformed(line(MAX_LINE) + end), 0, "{end:?}");
            assert_eq!(malformed(line(MAX_LINE - 1) + end), 0, "{end:?}");
            assert_eq!(malformed(line(MAX_LINE + 1) + end), 1, "{end:?}");
        }
        // A carriage return alone is no line end.
        assert_eq!(malformed(line(MAX_LINE) + "\r"), 1);
    }

    /// A read interrupted by a signal is retried: the line after it is read whole.
    #[test]
    fn an_interrupted_read_is_retried() {
        struct Interrupted<'a> {
            once: bool,
            kind: io::ErrorKind,
            rest: &'a [u8],
        }
        impl io::Read for Interrupted<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                self.rest.read(buf)
            }
        }
        impl BufRead for Interrupted<'_> {
            fn fill_buf(&mut self) -> io::Result<&[u8]> {
                if std::mem::take(&mut self.once) {
                    return Err(self.kind.into());
                }
                self.rest.fill_buf()
            }
            fn consume(&mut self, n: usize) {
                self.rest.consume(n)
            }
        }
        let line = br#"{"op":"alloc","id":1,"size":1,"mem":"host"}"#;
        let input = |kind| Interrupted {
            once: true,
            kind,
            rest: line,
        };
        let mut r = TraceReader::new(input(io::ErrorKind::Interrupted), TraceConfig::default());
        assert!(matches!(
            r.next_item(),
            Some(Ok(TraceItem::Op(TraceOp::Alloc { id: 1, .. })))
        ));
        assert!(r.next_item().is_none());
        assert_eq!(r.lines(), 1);
        // Any other error is the caller's to see, and reading may go on after it.
        let mut r = TraceReader::new(input(io::ErrorKind::BrokenPipe), TraceConfig::default());
        assert!(matches!(r.next_item(), Some(Err(e)) if e.kind() == io::ErrorKind::BrokenPipe));
        assert!(matches!(r.next_item(), Some(Ok(TraceItem::Op(_)))));
    }

    /// A kind's live bytes stay within its share of `u64::MAX`, however large the device.
    #[test]
    fn live_bytes_past_a_kinds_share_are_refused() {
        let config = TraceConfig {
            device_size: u64::MAX,
            ..TraceConfig::default()
        };
        let half = LIVE_BYTES_PER_KIND_MAX / 2;
        let text = format!(
            "{{\"op\":\"alloc\",\"id\":1,\"size\":{half},\"mem\":\"host\"}}\n\
             {{\"op\":\"alloc\",\"id\":2,\"size\":{half},\"mem\":\"host\"}}\n\
             {{\"op\":\"alloc\",\"id\":3,\"size\":{half},\"mem\":\"dvpp\"}}\n"
        );
        let mut r = TraceReader::new(text.as_bytes(), config);
        let mut kinds = Vec::new();
        while let Some(i) = r.next_item() {
            kinds.push(match i.unwrap() {
                TraceItem::Op(_) => None,
                TraceItem::Rejected(j) => Some(j.kind),
            });
        }
        // The second host allocation would pass the share with its padding; another kind
        // has a share of its own.
        assert_eq!(kinds, [None, Some(RejectKind::SizeTooLarge), None]);
        assert_eq!(r.kind_stats()[MemKind::Host.index()].allocs, 1);
    }

    #[test]
    fn peaks_by_hand() {
        // host: 1 -> 64, 100 -> 192; dvpp (128): 1 -> 128; device align 256: 1 -> 256.
        let text = r#"{"op":"alloc","id":1,"size":1,"mem":"host"}
{"op":"alloc","id":2,"size":100,"mem":"host"}
{"op":"free","id":1}
{"op":"alloc","id":3,"size":1,"mem":"dvpp"}
{"op":"alloc","id":4,"size":1,"mem":"device","align":256}
{"op":"alloc","id":5,"size":1,"mem":"host"}
"#;
        let r = replay(
            text.as_bytes(),
            TraceConfig::default(),
            &BumpFactory,
            |_| {},
        )
        .unwrap();
        assert_eq!(r.ops, 6);
        assert_eq!(r.errors.total(), 0);
        // host peak: 64+192 = 256 (then 192+64 = 256 again); requested 101.
        // dvpp 128 (req 1), device 256 (req 1).
        assert_eq!(r.peak_required_bytes, 256 + 128 + 256);
        assert_eq!(r.peak_requested_bytes, 101 + 1 + 1);
        // Bump never reuses: host 64 + 192 + 64 = 320.
        assert_eq!(r.peak_reserved_bytes, 320 + 128 + 256);
        assert_eq!(r.backend_alloc_calls, 3);
        assert_eq!((r.backend_free_calls, r.source_calls.free), (0, 0));
        assert_eq!(r.live_at_end, 4);
        // A range that gives nothing back holds its high water all along.
        let config = TraceConfig {
            timeline: true,
            ..TraceConfig::default()
        };
        let r = replay(text.as_bytes(), config, &BumpFactory, |_| {}).unwrap();
        assert_eq!(r.backend, "bump");
        let reserved: Vec<u64> = r.timeline.iter().map(|p| p.reserved).collect();
        assert_eq!(reserved, [64, 256, 256, 384, 640, 704]);
    }

    #[test]
    fn engine_replays_and_validates() {
        let text = r#"{"op":"alloc","id":1,"size":1,"mem":"host"}
{"op":"alloc","id":2,"size":5000,"mem":"host"}
{"op":"free","id":1}
{"op":"alloc","id":3,"size":3110400,"mem":"dvpp"}
{"op":"free","id":3}
"#;
        for range in [
            crate::engine::RangeTier::Tlsf,
            crate::engine::RangeTier::Buddy,
        ] {
            let f = EngineFactory {
                config: crate::engine::EngineConfig {
                    range,
                    ..Default::default()
                },
            };
            let r = replay(text.as_bytes(), TraceConfig::default(), &f, |_| {}).unwrap();
            assert_eq!(r.errors.total(), 0);
            assert!(r.invariant_errors.is_empty(), "{:?}", r.invariant_errors);
            assert_eq!(r.peak_required_bytes, 64 + 5056 + 3_110_528);
            assert!(r.peak_reserved_bytes >= r.peak_required_bytes);
        }
    }

    /// A replayer that places every segment at `at` (none: out of memory) and reports a
    /// fixed high water, whatever happens.
    #[derive(Clone, Copy)]
    struct Fixed {
        at: Option<u64>,
        high_water: u64,
    }
    impl RangeReplayer for Fixed {
        type Token = ();
        fn alloc(&mut self, _len: u64, _rule: CarveRule) -> Option<(u64, ())> {
            self.at.map(|at| (at, ()))
        }
        fn free(&mut self, _token: ()) {}
        fn high_water(&self) -> u64 {
            self.high_water
        }
    }
    impl ReplayerFactory for Fixed {
        type Replayer = Fixed;
        fn name(&self) -> &str {
            "fixed"
        }
        fn new_range(&self, _kind: MemKind, _capacity: u64) -> Result<Fixed, String> {
            Ok(*self)
        }
    }
    /// Hands every segment out at offset 64 and under-reports its high water.
    const LIAR: Fixed = Fixed {
        at: Some(64),
        high_water: 1,
    };
    /// Holds nothing: every allocation runs out of memory.
    const FULL: Fixed = Fixed {
        at: None,
        high_water: 0,
    };

    #[test]
    fn placement_check_catches_overlap_alignment_and_high_water() {
        let text = r#"{"op":"alloc","id":1,"size":1,"mem":"host"}
{"op":"alloc","id":2,"size":1,"mem":"dvpp"}
{"op":"alloc","id":3,"size":1,"mem":"host"}
"#;
        let config = TraceConfig {
            check_placement: true,
            ..TraceConfig::default()
        };
        let r = replay(text.as_bytes(), config, &LIAR, |_| {}).unwrap();
        let all = r.invariant_errors.join("\n");
        assert!(all.contains("host: 64..128 overlaps live 64..128"), "{all}");
        assert!(all.contains("dvpp: offset 64 is not 128-aligned"), "{all}");
        assert!(all.contains("high water 1 is below"), "{all}");
        assert!(r.placement_checked);
        // The honest bump replayer passes.
        let r = replay(text.as_bytes(), config, &BumpFactory, |_| {}).unwrap();
        assert!(r.invariant_errors.is_empty());
        // Unchecked, the liar's placements go unseen, and the report says they were not looked at.
        let r = replay(text.as_bytes(), TraceConfig::default(), &LIAR, |_| {}).unwrap();
        assert!(!r.placement_checked);
        assert!(!r.invariant_errors.join("\n").contains("overlaps"));
    }

    /// The placement check at its edges: a segment may end at the capacity and touch its
    /// neighbours, a freed one leaves no trace, and past ten problems the rest are counted.
    #[test]
    fn placement_check_edges_and_its_count_of_problems() {
        let host = MemKind::Host;
        let mut c = PlacementCheck::default();
        c.alloc(host, 64, 64, 64, Some(192));
        c.alloc(host, 128, 64, 64, Some(192)); // touches 64..128, ends at the capacity
        c.alloc(host, 0, 64, 64, Some(192)); // touches 64..128 from below
        c.free(host, 64);
        c.alloc(host, 64, 64, 64, Some(192)); // where a freed one was
        assert!(c.problems.is_empty(), "{:?}", c.problems);
        c.alloc(host, 192, 64, 64, Some(192));
        assert_eq!(c.problems, ["host: 192..256 passes the capacity 192"]);
        // One start handed out twice is one problem, and either copy stays checked after
        // the other is freed.
        let mut c = PlacementCheck::default();
        c.alloc(host, 64, 64, 64, None);
        c.alloc(host, 64, 64, 64, None);
        assert_eq!(c.problems, ["host: 64..128 overlaps live 64..128"]);
        c.free(host, 64);
        c.alloc(host, 0, 128, 64, None);
        assert_eq!(c.problems.len(), 2, "{:?}", c.problems);
        assert_eq!(c.problems[1], "host: 0..128 overlaps live 64..128");
        let hw = |h: u64| {
            let mut ranges: [Option<Fixed>; KIND_COUNT] = Default::default();
            ranges[host.index()] = Some(LIAR);
            let mut c = PlacementCheck::default();
            c.alloc(host, 0, h, 64, None);
            c.finish(&ranges)
        };
        // The liar's high water is 1: enough for a segment that ends at 1, not at 2.
        assert!(hw(1).is_empty());
        assert_eq!(hw(2), ["host: high water 1 is below the highest end 2"]);
        // Thirteen problems (twelve starts, then a range that never existed has a high
        // water of 0): ten kept, the other three counted.
        let mut c = PlacementCheck::default();
        for i in 0..12 {
            c.alloc(host, i * 64 + 1, 64, 64, None);
        }
        let ranges: [Option<Fixed>; KIND_COUNT] = Default::default();
        let problems = c.finish(&ranges);
        assert_eq!(problems.len(), 11);
        assert_eq!(problems[0], "host: offset 1 is not 64-aligned");
        assert_eq!(problems[10], "... and 3 more placement problems");
    }

    /// A kind whose every allocation was refused still has its line in the report: it
    /// reserved nothing, but the trace asked for it.
    #[test]
    fn a_kind_that_got_nothing_is_still_reported() {
        let text = r#"{"op":"alloc","id":1,"size":1,"mem":"dvpp"}"#;
        let r = replay(text.as_bytes(), TraceConfig::default(), &FULL, |_| {}).unwrap();
        assert_eq!(r.errors.get(RejectKind::OutOfMemory), 1);
        assert_eq!(r.per_kind.len(), 1);
        let k = r.per_kind[0];
        assert_eq!((k.mem, k.allocs, k.peak_reserved_bytes), ("dvpp", 1, 0));
    }

    /// `progress` hears of the bytes read every 8,192 valid events, then once at the end.
    #[test]
    fn progress_is_reported_along_the_way() {
        let line =
            |i: u64| format!("{{\"op\":\"alloc\",\"id\":{i},\"size\":1,\"mem\":\"host\"}}\n");
        let text: String = (0..2 * 8192 + 5).map(line).collect();
        let mut seen = Vec::new();
        replay(text.as_bytes(), TraceConfig::default(), &BumpFactory, |b| {
            seen.push(b)
        })
        .unwrap();
        let at = |ops: u64| (0..ops).map(|i| line(i).len() as u64).sum::<u64>();
        assert_eq!(seen, [at(8192), at(2 * 8192), text.len() as u64]);
    }

    /// The trace's fullest moment is the first event that reaches the largest live total.
    #[test]
    fn the_fullest_moment_is_the_first_at_the_peak() {
        let text = r#"{"op":"alloc","id":1,"size":1,"mem":"host"}
{"op":"alloc","id":2,"size":1,"mem":"host"}
{"op":"free","id":1}
{"op":"alloc","id":3,"size":1,"mem":"host"}
"#;
        assert_eq!(
            fullest_op(text.as_bytes(), TraceConfig::default()).unwrap(),
            Some(2)
        );
        assert_eq!(
            fullest_op(&b"\n"[..], TraceConfig::default()).unwrap(),
            None
        );
    }

    /// The engine replayer: named by its range tier, one engine per range rounded down to
    /// whole 64-byte units, and a free the engine refuses reported by `validate`.
    #[test]
    fn engine_replayer_names_capacity_and_refused_frees() {
        let buddy = EngineFactory {
            config: crate::engine::EngineConfig {
                range: crate::engine::RangeTier::Buddy,
                ..Default::default()
            },
        };
        assert_eq!(EngineFactory::default().name(), "ascend-pool");
        assert_eq!(buddy.name(), "ascend-pool (buddy tier)");
        let mut r = EngineFactory::default()
            .new_range(MemKind::Host, 100_000)
            .unwrap();
        assert_eq!(r.engine().capacity(), 99_968);
        refuses_a_second_free(&mut r);
    }

    /// Frees one segment twice: `validate` passes after the first free and reports the
    /// second, which the allocator refuses.
    fn refuses_a_second_free<R: RangeReplayer>(r: &mut R)
    where
        R::Token: Clone,
    {
        let (_, a) = r.alloc(100, MemKind::Host.carve_rule()).unwrap();
        r.free(a.clone());
        r.validate().unwrap();
        r.free(a);
        assert_eq!(r.validate(), Err("1 frees were refused".to_string()));
    }

    /// The locked engine frees into the engine it came from, and reports refused frees.
    #[test]
    fn locked_engine_replayer_reuses_what_it_frees() {
        let f = LockedEngineFactory::default();
        assert_eq!(f.name(), "ascend-pool (locked)");
        let mut r = f.new_range(MemKind::Host, 1 << 20).unwrap();
        let rule = MemKind::Host.carve_rule();
        let (at, a) = r.alloc(1000, rule).unwrap();
        r.free(a);
        let (again, b) = r.alloc(1000, rule).unwrap();
        assert_eq!(again, at);
        r.free(b);
        refuses_a_second_free(&mut r);
    }

    /// The pool replays over either block source with every check passing: the pool's
    /// own, its source calls against the simulator's, or its device bytes against the
    /// virtual-memory source's.
    #[test]
    fn pool_ranges_over_either_source_pass_their_checks() {
        let text = r#"{"op":"alloc","id":1,"size":5000000,"mem":"device"}
{"op":"alloc","id":2,"size":100,"mem":"dvpp"}
{"op":"free","id":1}
{"op":"alloc","id":3,"size":3000,"mem":"device"}
"#;
        let config = crate::pool::PoolConfig::default().with_thread_cache(0);
        for (source, name) in [(ReplaySource::Sim, "sim"), (ReplaySource::Vmm, "vmm")] {
            assert_eq!(source.name(), name);
            let f = PoolFactory::new(config.clone(), 1 << 30)
                .unwrap()
                .with_source(source);
            assert_eq!(f.source(), source);
            assert_eq!(f.pool_config().thread_cache, 0);
            let r = replay(text.as_bytes(), TraceConfig::default(), &f, |_| {}).unwrap();
            assert!(
                r.invariant_errors.is_empty(),
                "{name}: {:?}",
                r.invariant_errors
            );
            assert_eq!(r.errors.total(), 0);
            // A segment cannot be freed twice: `PoolSegment` is not `Clone` (its doc test).
        }
    }

    #[test]
    fn timeline_halves_and_keeps_every_maximum() {
        let mut t = TimelineRecorder::new();
        let n = 3 * TIMELINE_MAX_POINTS as u64 + 7;
        for op in 1..=n {
            // One spike per series, at different events.
            let spike = |at: u64| if op == at { 1_000_000 } else { op % 100 };
            t.record(op, spike(17), spike(4000), spike(n));
        }
        assert!(t.points.len() <= TIMELINE_MAX_POINTS);
        assert_eq!(t.step, 4, "2048 points of 4 events cover 6151 events");
        assert_eq!(t.points[0].op, 1);
        assert!(t.points.windows(2).all(|w| w[1].op == w[0].op + t.step));
        let max = |f: fn(&TimelinePoint) -> u64| t.points.iter().map(f).max().unwrap();
        assert_eq!(max(|p| p.requested), 1_000_000);
        assert_eq!(max(|p| p.required), 1_000_000);
        assert_eq!(max(|p| p.reserved), 1_000_000);
    }

    /// A chunk trimmed on virtual memory keeps the granule straddling its new end mapped:
    /// the pool counts it as held, as the source maps it (the pool counted only the bytes
    /// it asked to keep, and `validate` found the two apart).
    #[test]
    fn a_trimmed_chunk_counts_what_the_source_still_maps() {
        let trace: &[u8] =
            br#"{"op":"alloc","id":13,"size":73400320,"mem":"cached","align":2097152}
{"op":"alloc","id":14,"size":4096,"mem":"cached"}
{"op":"free","id":14}
{"op":"free","id":13}
{"op":"alloc","id":68,"size":3145728,"mem":"cached","align":128}
{"op":"alloc","id":70,"size":73400320,"mem":"device_align32","align":4096}
"#;
        let device_size = 100_000_000;
        let config = TraceConfig {
            device_size,
            check_placement: true,
            ..TraceConfig::default()
        };
        let factory = PoolFactory::new(crate::PoolConfig::default(), device_size).unwrap();
        let r = replay(trace, config, &factory, |_| {}).unwrap();
        assert!(r.invariant_errors.is_empty(), "{:?}", r.invariant_errors);
    }

    #[test]
    fn timeline_and_snapshot_through_the_pool() {
        let text = r#"{"op":"alloc","id":1,"size":1,"mem":"host"}
{"op":"alloc","id":2,"size":3110400,"mem":"dvpp"}
{"op":"free","id":2}
{"op":"free","id":1}
"#;
        assert_eq!(
            fullest_op(text.as_bytes(), TraceConfig::default()).unwrap(),
            Some(2)
        );
        let config = TraceConfig {
            timeline: true,
            snapshot_at: Some(2),
            check_placement: true,
            ..TraceConfig::default()
        };
        let f = PoolFactory::new(crate::pool::PoolConfig::default(), DEFAULT_DEVICE_SIZE).unwrap();
        let r = replay(text.as_bytes(), config, &f, |_| {}).unwrap();
        assert!(r.invariant_errors.is_empty(), "{:?}", r.invariant_errors);
        let reserved: Vec<u64> = r.timeline.iter().map(|p| p.reserved).collect();
        assert_eq!(reserved, [2 << 20, 6 << 20, 6 << 20, 6 << 20]);
        let required: Vec<u64> = r.timeline.iter().map(|p| p.required).collect();
        assert_eq!(required, [64, 64 + 3_110_528, 64, 0]);
        let snap = r.snapshot.expect("the pool has a snapshot");
        let live: usize = snap
            .kinds
            .iter()
            .flat_map(|k| &k.chunks)
            .map(|c| c.segments.len())
            .sum();
        assert_eq!(live, 2);
        // Ranges have no snapshot.
        let r = replay(text.as_bytes(), config, &BumpFactory, |_| {}).unwrap();
        assert!(r.snapshot.is_none() && r.timeline.len() == 4);
    }

    #[test]
    fn quantiles() {
        let mut v: Vec<u32> = (1..=100).collect();
        assert_eq!(quantile(&mut v, 0.5), 50);
        assert_eq!(quantile(&mut v, 0.99), 99);
        assert_eq!(quantile(&mut v, 1.0), 100);
        assert_eq!(quantile(&mut [], 0.5), 0);
    }
}
