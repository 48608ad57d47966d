//! Pool configuration: a builder, and `ASCEND_POOL_CONF` strings in the style of
//! `PYTORCH_NPU_ALLOC_CONF` (`key:value` pairs separated by commas).

use crate::engine::{EngineConfig, RangeTier};
use crate::error::{Error, Result};
use crate::kind::MallocPolicy;
use crate::source::DeviceId;

/// The environment variable [`PoolConfig::from_env`] reads.
pub const CONF_ENV: &str = "ASCEND_POOL_CONF";

/// How a pool grows, trims and checks itself.
///
/// | key (`ASCEND_POOL_CONF`) | field | default |
/// |---|---|---|
/// | `chunk_size` | [`chunk_size`](Self::chunk_size): largest ordinary block taken from the source | `128m` |
/// | `large_threshold` | [`large_threshold`](Self::large_threshold): requests at least this big get a chunk of their own size | `chunk_size / 2` |
/// | `padding` | [`padding`](Self::padding): carve-rule padding after each segment | `32` |
/// | `limit` | [`limit`](Self::limit): most bytes one memory kind may reserve (`0` = none, else at least `2m`) | `0` |
/// | `total_limit` | [`total_limit`](Self::total_limit): most bytes the device kinds together may reserve (`0` = none, else at least `2m`) | `0` |
/// | `release_threshold` | [`release_threshold`](Self::release_threshold): empty chunks beyond this many bytes go back at once (all of them before the kind grows) | `128m` |
/// | `debug` | [`debug`](Self::debug): canaries in the padding, checked on free | `0` |
/// | `thread_cache` | [`thread_cache`](Self::thread_cache): bytes of free segments each thread may keep (`off` or `0` = no caches) | `2m` |
/// | `thread_cache_max` | [`thread_cache_max`](Self::thread_cache_max): largest footprint a thread cache keeps | `256k` |
/// | `slab_max` | largest footprint served by slabs (at most `256k`) | `1024` |
/// | `range` | `tlsf` or `buddy` | `tlsf` |
/// | `policy` | `huge_first`, `huge_only`, `normal_only`, `huge1g_only`, and each with `_p2p` | `huge_first` |
/// | `device` | device id | `0` |
/// | `record` | [`record`](Self::record): write every allocation and free to this JSON Lines trace | none |
///
/// Sizes take `k`, `m`, `g` suffixes (powers of 1024). A key given twice takes its last value,
/// so a script can append overrides to a base string (`"$BASE,limit:8g"`).
///
/// ```
/// use ascend_pool::pool::PoolConfig;
/// let c = PoolConfig::parse("chunk_size:64m,padding:32,debug:1,thread_cache:off").unwrap();
/// assert_eq!(c.chunk_size, 64 << 20);
/// assert!(c.debug);
/// assert_eq!(c.thread_cache, 0);
/// assert!(PoolConfig::parse("chunk_size:lots").is_err());
/// assert_eq!(PoolConfig::parse("limit:4g,limit:8g").unwrap().limit, 8 << 30);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Largest ordinary chunk taken from the block source (a multiple of 2 MiB). A kind's
    /// chunks grow from one 2 MiB granule towards it as the kind holds more: each new chunk
    /// is about `sqrt(8 * 2 MiB * reserved)` less the free bytes the kind's chunks already
    /// hold (never below the request), so kinds that need little hold little, and a kind
    /// whose live bytes have levelled off grows by about what a request needs.
    pub chunk_size: u64,
    /// Requests whose footprint reaches this get a dedicated chunk of their own size. Set
    /// above `chunk_size`, requests between the two go to ordinary chunks, which grow to
    /// hold them.
    pub large_threshold: u64,
    /// Carve-rule padding after each segment (32 by default; 0 on newer SoCs).
    pub padding: u64,
    /// Most bytes one memory kind may reserve from the source; 0 means no limit. Chunks
    /// come in whole 2 MiB granules, so a limit is at least one granule (a smaller one is
    /// refused by [`validate`](Self::validate)), and bytes past its last whole granule are
    /// never reserved.
    pub limit: u64,
    /// Most bytes the device kinds of the pool (device memory, 32-aligned, cached, DVPP)
    /// may reserve together; 0 means no limit. They all draw on the device's HBM, so this
    /// is the cap a process that must leave room for others sets (as `torch_npu`'s memory
    /// fraction). Pinned host memory (`aclrtMallocHost`, page-locked host RAM) is not the
    /// device's and is not counted. At least one granule, as [`limit`](Self::limit).
    pub total_limit: u64,
    /// Bytes of empty chunks a kind keeps cached; beyond this they go back on free. Below
    /// `chunk_size`, a chunk that empties may go straight back and be asked for again.
    /// Whatever this says, a kind that must grow gives its empty chunks back first: they
    /// could not hold the request.
    pub release_threshold: u64,
    /// Fill each segment's padding with a canary and check it on free; a free that waits for
    /// streams is checked again once they have passed it (their work, queued before the
    /// free, may write past the end after it), an overrun found then going only to
    /// [`Pool::take_corruption_reports`](crate::Pool::take_corruption_reports) and stderr
    /// (stderr alone when the pool's drop completes the free).
    pub debug: bool,
    /// Footprint bytes of free segments each thread may keep per pool for reuse without
    /// locking; 0 turns thread caches off, and the kinds' shape slots for larger segments
    /// with them.
    pub thread_cache: u64,
    /// Largest footprint kept in a thread cache (at most `thread_cache`, below
    /// `large_threshold`).
    pub thread_cache_max: u64,
    /// Carving engine settings for each chunk.
    pub engine: EngineConfig,
    /// Malloc policy for device kinds.
    pub policy: MallocPolicy,
    /// Device the pool allocates on.
    pub device: DeviceId,
    /// Write every allocation and free to this file as a JSON Lines trace that
    /// `ascend-pool replay` reads (see [`record`](super::record)). The file is created or
    /// truncated when the pool is. In `ASCEND_POOL_CONF` the path runs to the next comma.
    pub record: Option<std::path::PathBuf>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            chunk_size: 128 << 20,
            large_threshold: 64 << 20,
            padding: crate::align::DEFAULT_PADDING,
            limit: 0,
            total_limit: 0,
            release_threshold: 128 << 20,
            debug: false,
            thread_cache: 2 << 20,
            thread_cache_max: 256 << 10,
            // Slabs only up to 1 KiB, not the bare engine's 176 KiB: each chunk's engine keeps
            // its own partial pages, so mid-sized classes cost the pool more than they save
            // (random-mix utilization 0.860 at 176 KiB, under the 0.87 target, against 0.874;
            // llm-serving 0.997 against 0.999; video's rises, 0.891 against 0.876).
            engine: EngineConfig {
                slab_max: 1024,
                ..EngineConfig::default()
            },
            policy: MallocPolicy::HugeFirst,
            device: 0,
            record: None,
        }
    }
}

/// Granule chunks are sized in: the device's huge page.
pub const CHUNK_GRANULE: u64 = 2 << 20;

fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim().to_ascii_lowercase();
    let (num, shift) = match v.strip_suffix(['k', 'm', 'g']) {
        Some(n) => (
            n,
            match v.as_bytes()[v.len() - 1] {
                b'k' => 10,
                b'm' => 20,
                _ => 30,
            },
        ),
        None => (v.as_str(), 0),
    };
    unsigned::<u64>(num)?.checked_mul(1u64 << shift)
}

/// A number in plain decimal digits: `u64::from_str` also takes a leading `+`, which no
/// size or device id is written with.
fn unsigned<T: std::str::FromStr>(v: &str) -> Option<T> {
    let v = v.trim();
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

impl PoolConfig {
    /// Reads [`CONF_ENV`]; defaults when it is unset. A value that is not Unicode is an
    /// [`Error::Config`], as a value that does not parse is: a limit or a recording asked
    /// for is never dropped in silence.
    pub fn from_env() -> Result<Self> {
        match std::env::var(CONF_ENV) {
            Ok(s) => Self::parse(&s),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(v)) => Err(Error::Config(format!(
                "{CONF_ENV} is not Unicode: {}",
                v.to_string_lossy()
            ))),
        }
    }

    /// Parses a `key:value,key:value` string over the defaults. Keys and named values are
    /// read in any ASCII case (`Debug:ON`), as `PYTORCH_NPU_ALLOC_CONF`'s `True` and `False`
    /// are; a record path is taken as written.
    pub fn parse(s: &str) -> Result<Self> {
        let mut c = Self::default();
        let mut large_set = false;
        let mut cache_max_set = false;
        let mut cache_set = false;
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item
                .split_once(':')
                .ok_or_else(|| Error::Config(format!("`{item}` is not key:value")))?;
            let size = || {
                parse_size(v).ok_or_else(|| Error::Config(format!("`{v}` is not a size for {k}")))
            };
            // Named values in lower case; the record path keeps `v`.
            let word = v.trim().to_ascii_lowercase();
            match k.trim().to_ascii_lowercase().as_str() {
                "chunk_size" => c.chunk_size = size()?,
                "large_threshold" => {
                    c.large_threshold = size()?;
                    large_set = true;
                }
                "padding" => c.padding = size()?,
                "limit" => c.limit = size()?,
                "total_limit" => c.total_limit = size()?,
                "release_threshold" => c.release_threshold = size()?,
                "slab_max" => c.engine.slab_max = size()?,
                "thread_cache" => {
                    c.thread_cache = match word.as_str() {
                        "off" | "false" => 0,
                        _ => size()?,
                    };
                    cache_set = true;
                }
                "thread_cache_max" => {
                    c.thread_cache_max = size()?;
                    cache_max_set = true;
                }
                "debug" => {
                    c.debug = match word.as_str() {
                        "1" | "true" | "on" => true,
                        "0" | "false" | "off" => false,
                        _ => return Err(Error::Config(format!("debug:{v} is not 0 or 1"))),
                    }
                }
                "range" => {
                    c.engine.range = match word.as_str() {
                        "tlsf" => RangeTier::Tlsf,
                        "buddy" => RangeTier::Buddy,
                        _ => return Err(Error::Config(format!("range:{v} is not tlsf or buddy"))),
                    }
                }
                "policy" => {
                    c.policy = match word.as_str() {
                        "huge_first" => MallocPolicy::HugeFirst,
                        "huge_only" => MallocPolicy::HugeOnly,
                        "normal_only" => MallocPolicy::NormalOnly,
                        "huge1g_only" => MallocPolicy::Huge1gOnly,
                        // Memory other devices reach directly (HCCL's peer-to-peer paths).
                        "huge_first_p2p" => MallocPolicy::HugeFirstP2p,
                        "huge_only_p2p" => MallocPolicy::HugeOnlyP2p,
                        "normal_only_p2p" => MallocPolicy::NormalOnlyP2p,
                        "huge1g_only_p2p" => MallocPolicy::Huge1gOnlyP2p,
                        _ => return Err(Error::Config(format!("unknown policy {v}"))),
                    }
                }
                "device" => {
                    c.device = unsigned(v)
                        .ok_or_else(|| Error::Config(format!("device:{v} is not a device id")))?
                }
                "record" => {
                    let path = v.trim();
                    if path.is_empty() {
                        return Err(Error::Config("record needs a file path".into()));
                    }
                    c.record = Some(path.into());
                }
                _ => return Err(Error::Config(format!("unknown key `{}`", k.trim()))),
            }
        }
        if !large_set {
            c.large_threshold = c.chunk_size / 2;
        }
        if !cache_set && !cache_max_set && c.large_threshold == 0 {
            // Every request takes a dedicated chunk, and no footprint is below the threshold
            // for a cache to keep: the caches are off, rather than a maximum refused. A cache
            // the caller named is not dropped in silence: that clash is refused below.
            c.thread_cache = 0;
        }
        if !cache_max_set && c.thread_cache > 0 {
            // A small cache keeps segments up to its own size by default.
            c.thread_cache_max = c.thread_cache_max.min(c.thread_cache);
            // And a small large_threshold alone lowers it too: "large_threshold:128k" was
            // refused for the default 256k it never named.
            if c.thread_cache_max >= c.large_threshold {
                c.thread_cache_max = c.large_threshold.saturating_sub(1);
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks that the settings make sense together.
    pub fn validate(&self) -> Result<()> {
        if self.chunk_size == 0 || self.chunk_size % CHUNK_GRANULE != 0 {
            return Err(Error::Config(format!(
                "chunk_size {} is not a non-zero multiple of 2 MiB",
                self.chunk_size
            )));
        }
        let engine_max = self.engine.range.max_capacity();
        if self.chunk_size > engine_max {
            return Err(Error::Config(format!(
                "chunk_size {} is past what the engine addresses, {engine_max}",
                self.chunk_size
            )));
        }
        // The rule's own refusal, as the configuration's: the caller fixes a key, not a size.
        crate::align::CarveRule::new(self.padding, 64).map_err(|e| Error::Config(e.to_string()))?;
        // Chunks come in whole granules: under one, every allocation would pass the limit.
        for (key, limit) in [("limit", self.limit), ("total_limit", self.total_limit)] {
            if limit != 0 && limit < CHUNK_GRANULE {
                return Err(Error::Config(format!(
                    "{key} {limit} is below one chunk granule (2 MiB): no chunk could be taken"
                )));
            }
        }
        // AscendCL device ids count from 0: a negative one names no device, and would only
        // be refused at the pool's first allocation.
        if self.device < 0 {
            return Err(Error::Config(format!(
                "device {} is not a device id",
                self.device
            )));
        }
        if self.thread_cache > 0
            && (self.thread_cache_max > self.thread_cache
                || self.thread_cache_max >= self.large_threshold)
        {
            return Err(Error::Config(format!(
                "thread_cache_max {} must fit in thread_cache {} and stay below large_threshold {}",
                self.thread_cache_max, self.thread_cache, self.large_threshold
            )));
        }
        let slab_max = self.engine.slab_max;
        if slab_max % 64 != 0
            || slab_max > self.chunk_size / 64
            || slab_max > crate::engine::slab::MAX_SLAB_FOOTPRINT
        {
            return Err(Error::Config(format!(
                "slab_max {slab_max} is not a multiple of 64 well below chunk_size, up to {}",
                crate::engine::slab::MAX_SLAB_FOOTPRINT
            )));
        }
        Ok(())
    }

    /// Builder: largest ordinary chunk (a multiple of 2 MiB); the large threshold follows.
    pub fn with_chunk_size(mut self, bytes: u64) -> Self {
        self.chunk_size = bytes;
        self.large_threshold = bytes / 2;
        self
    }
    /// Builder: memory limit per kind.
    pub fn with_limit(mut self, bytes: u64) -> Self {
        self.limit = bytes;
        self
    }
    /// Builder: memory limit over the device kinds together (see
    /// [`total_limit`](Self::total_limit)).
    pub fn with_total_limit(mut self, bytes: u64) -> Self {
        self.total_limit = bytes;
        self
    }
    /// Builder: carve-rule padding.
    pub fn with_padding(mut self, bytes: u64) -> Self {
        self.padding = bytes;
        self
    }
    /// Builder: canaries in padding.
    pub fn with_debug(mut self, on: bool) -> Self {
        self.debug = on;
        self
    }
    /// Builder: bytes each thread cache may hold (0 = no thread caches); the largest
    /// footprint kept shrinks to fit.
    pub fn with_thread_cache(mut self, bytes: u64) -> Self {
        self.thread_cache = bytes;
        if bytes > 0 {
            self.thread_cache_max = self.thread_cache_max.min(bytes);
        }
        self
    }
    /// Builder: largest footprint a thread cache keeps.
    pub fn with_thread_cache_max(mut self, bytes: u64) -> Self {
        self.thread_cache_max = bytes;
        self
    }
    /// Builder: empty-chunk bytes kept cached.
    pub fn with_release_threshold(mut self, bytes: u64) -> Self {
        self.release_threshold = bytes;
        self
    }
    /// Builder: device id.
    pub fn with_device(mut self, device: DeviceId) -> Self {
        self.device = device;
        self
    }
    /// Builder: record every allocation and free to a JSON Lines trace at `path`.
    pub fn with_record(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.record = Some(path.into());
        self
    }
    /// Builder: engine settings.
    pub fn with_engine(mut self, engine: EngineConfig) -> Self {
        self.engine = engine;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_key() {
        let c = PoolConfig::parse(
            "chunk_size:64m, padding:0, limit:8g, release_threshold:128m, debug:on, \
             slab_max:2k, range:buddy, policy:huge1g_only, device:3, thread_cache:1m, \
             thread_cache_max:64k, record:/tmp/a:b.jsonl",
        )
        .unwrap();
        assert_eq!(c.chunk_size, 64 << 20);
        assert_eq!(c.large_threshold, 32 << 20);
        assert_eq!(c.padding, 0);
        assert_eq!(c.limit, 8 << 30);
        assert_eq!(c.release_threshold, 128 << 20);
        assert!(c.debug);
        assert_eq!(c.engine.slab_max, 2048);
        assert_eq!(c.engine.range, RangeTier::Buddy);
        assert_eq!(c.policy, MallocPolicy::Huge1gOnly);
        assert_eq!(c.device, 3);
        assert_eq!(
            c.record.as_deref(),
            Some(std::path::Path::new("/tmp/a:b.jsonl"))
        );
        assert_eq!((c.thread_cache, c.thread_cache_max), (1 << 20, 64 << 10));
        let small = PoolConfig::parse("thread_cache:64k").unwrap();
        assert_eq!(
            (small.thread_cache, small.thread_cache_max),
            (64 << 10, 64 << 10)
        );
        let off = PoolConfig::parse("thread_cache:off").unwrap();
        // Off leaves the largest kept footprint as it was, for a later `with_thread_cache`.
        assert_eq!(
            (off.thread_cache, off.thread_cache_max),
            (0, PoolConfig::default().thread_cache_max)
        );
    }

    #[test]
    fn keys_and_named_values_in_any_case_and_the_record_path_as_written() {
        let upper = PoolConfig::parse(
            "Chunk_Size:64M, PADDING:0, Debug:ON, Range:Buddy, Policy:HUGE_ONLY_P2P, \
             Thread_Cache:Off, RECORD:/tmp/A.jsonl",
        )
        .unwrap();
        let lower = PoolConfig::parse(
            "chunk_size:64m, padding:0, debug:on, range:buddy, policy:huge_only_p2p, \
             thread_cache:off, record:/tmp/A.jsonl",
        )
        .unwrap();
        assert_eq!(upper, lower);
        assert_eq!(
            upper.record.as_deref(),
            Some(std::path::Path::new("/tmp/A.jsonl"))
        );
        // An unknown key is named as written.
        assert!(matches!(
            PoolConfig::parse("Chunk_Sise:64m"),
            Err(Error::Config(m)) if m.contains("`Chunk_Sise`")
        ));
    }

    #[test]
    fn parses_every_value_of_the_named_keys() {
        for (v, policy) in [
            ("huge_first", MallocPolicy::HugeFirst),
            ("huge_only", MallocPolicy::HugeOnly),
            ("normal_only", MallocPolicy::NormalOnly),
            ("huge1g_only", MallocPolicy::Huge1gOnly),
            ("huge_first_p2p", MallocPolicy::HugeFirstP2p),
            ("huge_only_p2p", MallocPolicy::HugeOnlyP2p),
            ("normal_only_p2p", MallocPolicy::NormalOnlyP2p),
            ("huge1g_only_p2p", MallocPolicy::Huge1gOnlyP2p),
        ] {
            // Start from a policy other than the default, so the default cannot pass.
            let c = PoolConfig::parse(&format!("policy:huge1g_only,policy:{v}")).unwrap();
            assert_eq!(c.policy, policy, "{v}");
        }
        for v in ["tlsf", " tlsf "] {
            let c = PoolConfig::parse(&format!("range:buddy,range:{v}")).unwrap();
            assert_eq!(c.engine.range, RangeTier::Tlsf, "{v}");
        }
        for (v, on) in [
            ("1", true),
            ("true", true),
            ("on", true),
            ("0", false),
            ("false", false),
            ("off", false),
        ] {
            let flipped = if on { "debug:0" } else { "debug:1" };
            let c = PoolConfig::parse(&format!("{flipped},debug:{v}")).unwrap();
            assert_eq!(c.debug, on, "debug:{v}");
        }
        for (v, bytes) in [
            ("3", 3),
            ("3k", 3 << 10),
            ("3M", 3 << 20),
            (" 3g ", 3 << 30),
        ] {
            // A size key that takes any value (a limit is at least one chunk granule).
            assert_eq!(
                PoolConfig::parse(&format!("release_threshold:{v}"))
                    .unwrap()
                    .release_threshold,
                bytes,
                "{v}"
            );
        }
    }

    #[test]
    fn slab_max_stays_a_multiple_of_64_within_its_tier_and_the_chunk() {
        let slab = |s: &str| PoolConfig::parse(s).map(|c| c.engine.slab_max);
        assert_eq!(slab("slab_max:256k").unwrap(), 256 << 10);
        assert_eq!(slab("chunk_size:2m,slab_max:32k").unwrap(), 32 << 10);
        for bad in [
            "slab_max:1000",
            "slab_max:1056",
            "slab_max:320k",
            "chunk_size:2m,slab_max:33k",
            "chunk_size:2m,slab_max:64k",
        ] {
            assert!(
                matches!(PoolConfig::parse(bad), Err(Error::Config(m)) if m.contains("slab_max")),
                "{bad} was accepted"
            );
        }
    }

    #[test]
    fn builders_set_what_they_name_and_nothing_else() {
        let d = PoolConfig::default();
        let c = d.clone().with_chunk_size(6 << 20);
        assert_eq!((c.chunk_size, c.large_threshold), (6 << 20, 3 << 20));
        assert_eq!(d.clone().with_padding(0).padding, 0);
        assert_eq!(d.clone().with_limit(5 << 30).limit, 5 << 30);
        assert!(d.clone().with_debug(true).debug);
        assert_eq!(d.clone().with_release_threshold(7).release_threshold, 7);
        assert_eq!(d.clone().with_device(5).device, 5);
        assert_eq!(d.clone().with_thread_cache_max(4096).thread_cache_max, 4096);
        let small = d.clone().with_thread_cache(64 << 10);
        assert_eq!(
            (small.thread_cache, small.thread_cache_max),
            (64 << 10, 64 << 10)
        );
        let big = d.clone().with_thread_cache(8 << 20);
        assert_eq!(
            (big.thread_cache, big.thread_cache_max),
            (8 << 20, d.thread_cache_max)
        );
        // Turning the caches off leaves the largest kept footprint for when they come back.
        let off = d.clone().with_thread_cache(0);
        assert_eq!(
            (off.thread_cache, off.thread_cache_max),
            (0, d.thread_cache_max)
        );
        let slabs = EngineConfig {
            slab_max: 4096,
            ..EngineConfig::default()
        };
        assert_eq!(d.clone().with_engine(slabs).engine, slabs);
        let rec = d.with_record("/tmp/x.jsonl");
        assert_eq!(
            rec.record.as_deref(),
            Some(std::path::Path::new("/tmp/x.jsonl"))
        );
        for c in [small, big, off, rec] {
            c.validate().unwrap();
        }
    }

    #[test]
    fn rejects_nonsense() {
        for bad in [
            "chunk_size:3m",
            "chunk_size:0",
            "padding:17",
            "debug:maybe",
            "frobnicate:1",
            "chunk_size",
            "limit:99999999999999999999g",
            "range:first_fit",
            "record:",
            "thread_cache:lots",
            "thread_cache:64k,thread_cache_max:128k",
            "thread_cache_max:32m",
            "chunk_size:256g", // past the TLSF engine's (2^32 - 1) * 64 bytes
            "device:-1",
            "device:+1",
            "limit:+1g",
            "padding:+32",
            "chunk_size:-2m",
            "limit:1_000",
            "limit:m",
        ] {
            assert!(PoolConfig::parse(bad).is_err(), "{bad} was accepted");
        }
        assert!(PoolConfig::default().with_device(-1).validate().is_err());
        assert_eq!(PoolConfig::parse("").unwrap(), PoolConfig::default());
        // The buddy tier takes chunks of any size.
        PoolConfig::parse("chunk_size:256g,range:buddy").unwrap();
    }

    #[test]
    fn a_small_large_threshold_alone_lowers_the_kept_footprint_below_it() {
        // Refused before: the default thread_cache_max (256k) reached the threshold.
        let c = PoolConfig::parse("large_threshold:128k").unwrap();
        assert_eq!(c.large_threshold, 128 << 10);
        assert!(c.thread_cache_max < c.large_threshold);
        c.validate().unwrap();
        // Named together, the caller's values stand, and a clash is still refused.
        let named = PoolConfig::parse("large_threshold:128k,thread_cache_max:64k").unwrap();
        assert_eq!(named.thread_cache_max, 64 << 10);
        assert!(PoolConfig::parse("large_threshold:128k,thread_cache_max:128k").is_err());
        // At 0 no footprint is below it: the caches go off, and nothing the caller did not
        // name is refused.
        let zero = PoolConfig::parse("large_threshold:0").unwrap();
        assert_eq!((zero.large_threshold, zero.thread_cache), (0, 0));
        let off = PoolConfig::parse("large_threshold:0,thread_cache:off").unwrap();
        assert_eq!(zero, off);
        assert!(PoolConfig::parse("large_threshold:0,thread_cache:4m").is_err());
        // A large threshold leaves the default alone.
        let big = PoolConfig::parse("large_threshold:1m").unwrap();
        assert_eq!(big.thread_cache_max, PoolConfig::default().thread_cache_max);
    }
}
