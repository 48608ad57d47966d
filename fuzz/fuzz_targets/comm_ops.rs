//! One-sided writes between two ranks of the simulator, driven the way a pipeline drives
//! them: source regions of any size are made and filled, written into two windows of the far
//! rank at any offsets and lengths, and freed at once, while the stream is held back now and
//! then (so writes queue up behind freed regions and new ones are made meanwhile), windows are
//! deregistered (once the writes into them have landed, as the writer's notifications would
//! tell a rank) and registered again, and the runtime refuses a write now and then.
//!
//! Notifications go alongside: rank 0 records them after its writes, rank 1's stream waits
//! for them (only for one a record already queued will answer, so no wait is left hanging),
//! and a wait no record can answer times out.
//!
//! Every call answers what a shadow model predicts: out-of-bounds ranges and host sources are
//! refused by the pool, writes into a deregistered window and planned faults by the runtime,
//! notification indices past the channel's by the runtime, and a refused write changes
//! nothing. After each synchronization the windows hold exactly the shadow's bytes: a source
//! region whose memory were reused before its queued write ran would show as other bytes
//! there. Rank 1's stream then passes every wait, and a wait that timed out is reported by
//! exactly one synchronize. At the end both pools are valid and hold nothing.
#![no_main]

use arbitrary::Arbitrary;
use ascend_pool::comm::{RegisteredWindow, RemoteWindow, WINDOW_GRANULE};
use ascend_pool::source::sim::{AclFunc, Fault, SimConfig, SimSource, CHANNEL_NOTIFIES};
use ascend_pool::{AclError, DeviceRegion, Error, HostRegion, Pool, PoolConfig, Region};
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;

const WINDOWS: usize = 2;
const WLEN: u64 = WINDOW_GRANULE;
/// Source regions alive at once, at most.
const SOURCES: usize = 12;
const MAX_OPS: usize = 96;

/// A length or offset: small, anywhere in a window, or past everything.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Num {
    Small(u16),
    InWindow(u32),
    Near(u8),
    Raw(u64),
}

impl Num {
    fn get(self) -> u64 {
        match self {
            Self::Small(n) => u64::from(n),
            Self::InWindow(n) => u64::from(n) % (WLEN + 1),
            Self::Near(n) => u64::MAX - u64::from(n),
            Self::Raw(v) => v,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// A source region of `len` bytes (1 to 512 KiB), filled with the next byte value.
    Alloc {
        len: u32,
        host: bool,
    },
    Free {
        src: u8,
    },
    Write {
        src: u8,
        window: u8,
        dst_offset: Num,
        src_offset: Num,
        len: Num,
    },
    Hold,
    Release,
    Sync,
    Toggle {
        window: u8,
    },
    Fault,
    /// Rank 0 records notification `index` (past the channel's at times).
    Record {
        index: u8,
    },
    /// Rank 1's stream waits for notification `index`, if a queued record will answer it.
    Wait {
        index: u8,
    },
    /// Rank 1 waits for notification `index` with a timeout when nothing can answer it.
    TimedOut {
        index: u8,
    },
}

/// Whether `got` is the runtime's refusal with `code`.
fn runtime_refused(got: &ascend_pool::Result<()>, code: AclError) -> bool {
    matches!(got, Err(Error::Runtime { code: c, .. }) if *c == code)
}

/// A notification index: mostly valid, past the channel's now and then.
fn notify_index(index: u8) -> u32 {
    u32::from(index) % (CHANNEL_NOTIFIES + 2)
}

struct Source {
    region: Result<DeviceRegion, HostRegion>,
    fill: u8,
    len: u64,
}

/// A window of rank 1: its region, registered or not.
enum Window {
    Registered(RegisteredWindow<DeviceRegion>),
    Unregistered(DeviceRegion),
}

impl Window {
    fn region(&self) -> &DeviceRegion {
        match self {
            Window::Registered(w) => w.region(),
            Window::Unregistered(r) => r,
        }
    }
}

fn window_bytes(pool: &Pool, w: &DeviceRegion) -> Vec<u8> {
    let mut out = vec![0u8; WLEN as usize];
    pool.copy_to_host(w, 0, &mut out).expect("read a window");
    out
}

fuzz_target!(|ops: Vec<Op>| {
    let sim = Arc::new(
        SimSource::new(SimConfig::default().with_devices(2)).expect("a simulator of two ranks"),
    );
    let rank0 = Pool::new(sim.clone(), PoolConfig::default().with_device(0)).expect("rank 0");
    let rank1 = Pool::new(sim.clone(), PoolConfig::default().with_device(1)).expect("rank 1");
    let channel = sim.acquire_channel(0, 1).expect("a channel");
    let mut windows = Vec::new();
    for _ in 0..WINDOWS {
        let mut w = rank1
            .alloc_device_aligned(WLEN, WINDOW_GRANULE)
            .expect("a window");
        rank1.memset(&mut w, 0, 0, WLEN).expect("clear a window");
        let w = rank1.register_window(w).expect("register");
        windows.push(Some(Window::Registered(w)));
    }
    // The simulator lists windows by address; the shadow goes by the order they were made.
    let listed = RemoteWindow::of_sim(&sim, channel).expect("windows");
    let far: Vec<RemoteWindow> = windows
        .iter()
        .map(|w| {
            let at = w
                .as_ref()
                .expect("every window is in place")
                .region()
                .addr();
            *listed.iter().find(|f| f.addr() == at).expect("listed")
        })
        .collect();
    let mut shadow = vec![vec![0u8; WLEN as usize]; WINDOWS];
    let mut registered = [true; WINDOWS];
    let stream = rank0.create_stream().expect("a stream");
    let thread = rank0.acquire_comm_thread(&stream).expect("a thread");
    let stream1 = rank1.create_stream().expect("rank 1's stream");
    let thread1 = rank1
        .acquire_comm_thread(&stream1)
        .expect("rank 1's thread");
    let back = sim.acquire_channel(1, 0).expect("the channel back");
    // Records queued less waits queued, per index: what later waits can still take.
    let mut available = vec![0u64; CHANNEL_NOTIFIES as usize];
    let mut sources: Vec<Source> = Vec::new();
    let mut hold = None;
    let mut fault_armed = false;
    let mut next_fill = 1u8;

    for op in ops.into_iter().take(MAX_OPS) {
        match op {
            Op::Alloc { len, host } => {
                if sources.len() == SOURCES {
                    continue;
                }
                let len = u64::from(len) % (512 << 10) + 1;
                let fill = next_fill;
                next_fill = next_fill.wrapping_add(1).max(1);
                let bytes = vec![fill; len as usize];
                let region = if host {
                    let mut h = rank0.alloc_host(len).expect("host memory");
                    h.as_mut_slice().copy_from_slice(&bytes);
                    Err(h)
                } else {
                    let mut d = rank0.alloc_device(len).expect("device memory");
                    rank0.copy_from_host(&mut d, 0, &bytes).expect("fill");
                    Ok(d)
                };
                sources.push(Source { region, fill, len });
            }
            Op::Free { src } => {
                if !sources.is_empty() {
                    let i = src as usize % sources.len();
                    drop(sources.swap_remove(i));
                }
            }
            Op::Write {
                src,
                window,
                dst_offset,
                src_offset,
                len,
            } => {
                if sources.is_empty() {
                    continue;
                }
                let s = &sources[src as usize % sources.len()];
                let w = window as usize % WINDOWS;
                let (dst_offset, src_offset, len) = (dst_offset.get(), src_offset.get(), len.get());
                let got = match &s.region {
                    Ok(d) => rank0.write_remote(&thread, &far[w], dst_offset, d, src_offset, len),
                    Err(h) => rank0.write_remote(&thread, &far[w], dst_offset, h, src_offset, len),
                };
                let fits =
                    |off: u64, cap: u64| len > 0 && off.checked_add(len).is_some_and(|e| e <= cap);
                if !fits(dst_offset, WLEN) || !fits(src_offset, s.len) {
                    assert!(matches!(got, Err(Error::OutOfBounds { .. })), "{got:?}");
                } else if s.region.is_err() {
                    assert!(matches!(got, Err(Error::WrongKind { .. })), "{got:?}");
                } else if fault_armed {
                    fault_armed = false;
                    assert!(runtime_refused(&got, AclError::HCCL_E_PTR), "{got:?}");
                } else if !registered[w] {
                    assert!(runtime_refused(&got, AclError::HCCL_E_PARA), "{got:?}");
                } else {
                    got.expect("a write inside a registered window");
                    let d = dst_offset as usize;
                    shadow[w][d..d + len as usize].fill(s.fill);
                }
            }
            Op::Hold => {
                if hold.is_none() {
                    hold = Some(sim.hold_stream(stream.handle()).expect("hold the stream"));
                }
            }
            Op::Release => drop(hold.take()),
            Op::Sync => {
                drop(hold.take());
                stream.synchronize().expect("synchronize");
                stream1
                    .synchronize()
                    .expect("every wait of rank 1 answered");
                for (w, window) in windows.iter().flatten().enumerate() {
                    assert!(
                        window_bytes(&rank1, window.region()) == shadow[w],
                        "window {w} differs"
                    );
                }
            }
            Op::Toggle { window } => {
                let w = window as usize % WINDOWS;
                windows[w] = Some(match windows[w].take().expect("in place") {
                    Window::Registered(window) => {
                        // The writes queued into it land first: a write still queued when
                        // its window goes lands nowhere (and fails its stream's task).
                        drop(hold.take());
                        stream.synchronize().expect("synchronize");
                        Window::Unregistered(window.into_region().expect("deregister"))
                    }
                    Window::Unregistered(region) => Window::Registered(
                        rank1
                            .register_window(region)
                            .map_err(|e| e.error)
                            .expect("register again"),
                    ),
                });
                registered[w] = !registered[w];
            }
            Op::Record { index } => {
                let i = notify_index(index);
                let got = sim.notify_record_on_thread(thread.handle(), channel, i);
                if i >= CHANNEL_NOTIFIES {
                    assert!(runtime_refused(&got, AclError::HCCL_E_PARA), "{got:?}");
                } else {
                    got.expect("a record");
                    available[i as usize] += 1;
                }
            }
            Op::Wait { index } => {
                let i = notify_index(index);
                if i < CHANNEL_NOTIFIES && available[i as usize] == 0 {
                    continue;
                }
                let got = sim.notify_wait_on_thread(thread1.handle(), back, i, 0);
                if i >= CHANNEL_NOTIFIES {
                    assert!(runtime_refused(&got, AclError::HCCL_E_PARA), "{got:?}");
                } else {
                    got.expect("a wait");
                    available[i as usize] -= 1;
                }
            }
            Op::TimedOut { index } => {
                let i = notify_index(index) % CHANNEL_NOTIFIES;
                // Every record already queued runs and is taken by rank 1's waits first.
                drop(hold.take());
                stream.synchronize().expect("synchronize");
                stream1
                    .synchronize()
                    .expect("every wait of rank 1 answered");
                if available[i as usize] > 0 {
                    continue;
                }
                sim.notify_wait_on_thread(thread1.handle(), back, i, 1)
                    .expect("a wait");
                let got = stream1.synchronize();
                assert!(runtime_refused(&got, AclError::RT_FAILURE), "{got:?}");
                stream1.synchronize().expect("reported once");
            }
            Op::Fault => {
                if !fault_armed {
                    sim.inject_fault(Fault::next(AclFunc::WriteOnThread, AclError::HCCL_E_PTR, 1));
                    fault_armed = true;
                }
            }
        }
        // Every call, refused or not, leaves both pools consistent.
        rank0.validate().expect("rank 0 valid after an operation");
        rank1.validate().expect("rank 1 valid after an operation");
    }

    drop(hold.take());
    drop(sources);
    stream.synchronize().expect("synchronize");
    stream1
        .synchronize()
        .expect("every wait of rank 1 answered");
    for (w, window) in windows.iter().flatten().enumerate() {
        assert!(
            window_bytes(&rank1, window.region()) == shadow[w],
            "window {w} differs at the end"
        );
    }
    drop(windows);
    for pool in [&rank0, &rank1] {
        pool.synchronize().expect("pending frees complete");
        pool.validate().expect("a valid pool");
        assert!(pool.leak_report().is_empty());
    }
    // With both pools gone, every block they took from the simulator is back.
    drop(stream1);
    drop(stream);
    drop((rank0, rank1));
    assert_eq!(sim.stats().live_blocks, 0, "blocks left at the simulator");
});
