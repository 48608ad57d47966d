//! Shared buffers carved from a pool: data, valid length, user data, references, and the
//! bounds every call checks.

#[path = "common/device.rs"]
mod common_device;

use std::sync::Arc;

use ascend_pool::mbuf::{Mbuf, MbufKind, HEADER_LEN};
use ascend_pool::share::Access;
use ascend_pool::source::sim::{SimConfig, SimSource};
use ascend_pool::source::vmm::{VmmConfig, VmmSource};
use ascend_pool::source::BlockSource;
use ascend_pool::{Error, MemKind, Pool, PoolConfig};

fn pool() -> Arc<Pool> {
    let sim = SimSource::new(SimConfig::default().with_device_capacity(256 << 20)).unwrap();
    Arc::new(Pool::new(Arc::new(sim), PoolConfig::default()).unwrap())
}

#[test]
fn buffers_carry_data_length_and_user_data_and_share_them_between_references() {
    let pool = pool();
    let ids = std::cell::RefCell::new(Vec::new());
    for (kind, mem) in [
        (MbufKind::Normal, MemKind::DEVICE),
        (MbufKind::Dvpp, MemKind::Dvpp),
    ] {
        let buf = Mbuf::alloc(&pool, 1920 * 1080, kind).unwrap();
        let (addr, size) = buf.data();
        assert_eq!((addr % 128, size), (0, 1920 * 1080));
        assert_eq!(buf.data_len().unwrap(), 0);
        buf.write(size - 5, b"frame").unwrap();
        buf.set_data_len(size).unwrap();
        buf.set_user_data(&[1; 16], 0).unwrap();
        buf.set_user_data(&[2; 16], 80).unwrap();

        let copy = buf.clone(); // acltdtCopyBufRef
        assert_eq!(copy.refs(), 2);
        drop(buf);
        assert_eq!(
            pool.stats(mem).live_regions,
            1,
            "a reference keeps the memory"
        );
        let mut end = [0u8; 5];
        copy.read(size - 5, &mut end).unwrap();
        assert_eq!(&end, b"frame");
        assert_eq!(copy.data_len().unwrap(), size);
        let mut user = [0u8; 96];
        copy.user_data(&mut user, 0).unwrap();
        assert_eq!(
            (&user[..16], &user[16..80], &user[80..]),
            (&[1u8; 16][..], &[0u8; 64][..], &[2u8; 16][..])
        );

        // Every bound is checked, against the buffer's own data or its 96 bytes of user
        // data (not the region's), and nothing is written past it.
        let past = |offset, len, capacity| {
            Err(Error::OutOfBounds {
                offset,
                len,
                capacity,
                side: None,
            })
        };
        assert_eq!(copy.set_data_len(size + 1), past(0, size + 1, size));
        assert_eq!(copy.set_user_data(&[0; 97], 0), past(0, 97, 96));
        assert_eq!(copy.set_user_data(&[0; 8], 89), past(89, 8, 96));
        assert_eq!(copy.user_data(&mut [0; 1], 96), past(96, 1, 96));
        assert_eq!(copy.set_user_data(&[], 0), past(0, 0, 96));
        assert_eq!(copy.user_data(&mut [], 96), past(96, 0, 96));
        assert_eq!(copy.write(size - 4, b"frame"), past(size - 4, 5, size));
        assert_eq!(copy.read(size, &mut [0; 1]), past(size, 1, size));
        assert_eq!(copy.read(u64::MAX, &mut [0; 1]), past(u64::MAX, 1, size));
        assert_eq!(copy.write(0, &[]), past(0, 0, size));
        assert_eq!(copy.read(size, &mut []), past(size, 0, size));
        assert_eq!(copy.data_len().unwrap(), size);
        // The header, as the device holds it, is the 128 bytes before the data.
        let mut header = [0u8; 128];
        header[..8].copy_from_slice(b"APMBUF01");
        header[8..16].copy_from_slice(&size.to_le_bytes());
        header[16..24].copy_from_slice(&size.to_le_bytes());
        header[24] = u8::from(kind == MbufKind::Dvpp);
        header[32..48].fill(1);
        header[112..128].fill(2);
        let got = common_device::read(pool.source().as_ref(), addr - HEADER_LEN as usize, 128);
        // The buffer's id: never 0, and another buffer's is another.
        assert_ne!(got[28..32], [0; 4]);
        assert_ne!(got[28..32], ids.replace(got[28..32].to_vec()));
        header[28..32].copy_from_slice(&got[28..32]);
        assert_eq!(got, header);
        let last = common_device::read(pool.source().as_ref(), addr + size as usize - 5, 5);
        assert_eq!(last, b"frame", "the data area starts where data() says");
        drop(copy);
        assert_eq!(pool.stats(mem).live_regions, 0);
    }
    assert!(matches!(
        Mbuf::alloc(&pool, 0, MbufKind::Normal),
        Err(Error::Carve(_))
    ));
    assert!(matches!(
        Mbuf::alloc(&pool, u64::MAX - 64, MbufKind::Normal),
        Err(Error::Carve(_))
    ));
    pool.validate().unwrap();
}

#[test]
fn dvpp_buffers_are_not_published_and_foreign_pools_are_refused() {
    let sim =
        Arc::new(SimSource::new(SimConfig::default().with_device_capacity(256 << 20)).unwrap());
    let vmm = Arc::new(VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default()).unwrap());
    let pool = Arc::new(Pool::new(vmm.clone(), PoolConfig::default()).unwrap());
    let dvpp = Mbuf::alloc(&pool, 4096, MbufKind::Dvpp).unwrap();
    let refused = dvpp.publish(&vmm, &Access::AnyProcess).unwrap_err();
    assert!(
        matches!(
            refused,
            Error::WrongKind {
                got: MemKind::Dvpp,
                ..
            }
        ),
        "{refused:?}"
    );
    assert_eq!(refused.to_string(), "expected device memory, got dvpp");
    let normal = Mbuf::alloc(&pool, 4096, MbufKind::Normal).unwrap();
    let desc = normal.publish(&vmm, &Access::AnyProcess).unwrap();
    assert_eq!(desc.len, 4096 + HEADER_LEN);
    // A buffer of another pool is not this source's memory.
    let other = Mbuf::alloc(&self::pool(), 4096, MbufKind::Normal).unwrap();
    assert!(matches!(
        other.publish(&vmm, &Access::AnyProcess),
        Err(Error::ForeignHandle)
    ));
}

/// The caller's own work on a buffer's data (a model's input, a DVPP call) is queued by
/// address; with the stream recorded, the memory goes back to the pool, with the last
/// handle, only once that work has run.
#[test]
fn a_buffer_used_on_a_stream_is_reused_only_once_the_stream_has_run() {
    let sim =
        Arc::new(SimSource::new(SimConfig::default().with_device_capacity(256 << 20)).unwrap());
    let pool = Arc::new(Pool::new(sim.clone(), PoolConfig::default()).unwrap());
    let stream = pool.create_stream().unwrap();
    for (kind, mem) in [
        (MbufKind::Normal, MemKind::DEVICE),
        (MbufKind::Dvpp, MemKind::Dvpp),
    ] {
        let buf = Mbuf::alloc(&pool, 4096, kind).unwrap();
        let (addr, size) = buf.data();
        let hold = sim.hold_stream(stream.handle()).unwrap();
        buf.record_stream(&stream).unwrap();
        // SAFETY: the buffer's data area, kept from reuse until the stream has passed the fill.
        unsafe { sim.memset_async(addr, size, 5, size, stream.handle()) }.unwrap();
        let copy = buf.clone();
        drop(buf);
        drop(copy);
        assert_eq!(pool.stats(mem).pending_frees, 1, "{kind:?}");
        // While the fill waits, the same size is not handed the same memory.
        let next = Mbuf::alloc(&pool, 4096, kind).unwrap();
        assert_ne!(next.data().0, addr, "{kind:?}");
        hold.release();
        stream.synchronize().unwrap();
        drop(next);
        pool.synchronize().unwrap();
        assert_eq!(pool.stats(mem).pending_frees, 0, "{kind:?}");
    }
    // A stream of another source names some other stream, or none, there.
    let other = pool_with_stream();
    let buf = Mbuf::alloc(&pool, 64, MbufKind::Normal).unwrap();
    assert_eq!(buf.record_stream(&other.1), Err(Error::ForeignHandle));
    drop(buf);
    pool.validate().unwrap();
    for s in pool.all_stats() {
        assert_eq!(s.live_regions, 0, "{:?}", s.kind);
    }
}

fn pool_with_stream() -> (Arc<Pool>, ascend_pool::Stream) {
    let pool = pool();
    let stream = pool.create_stream().unwrap();
    (pool, stream)
}

/// In debug mode a write past a buffer's data into its padding is reported when the last
/// handle lets go, as for a region: `free` returns it and the pool keeps it for
/// `take_corruption_reports` (all a dropped handle can do), and the memory still goes back.
#[test]
fn a_padding_overrun_is_reported_when_the_last_handle_lets_go() {
    use ascend_pool::source::MemcpyKind;
    let sim = SimSource::new(SimConfig::default().with_device_capacity(256 << 20)).unwrap();
    let pool = Arc::new(Pool::new(Arc::new(sim), PoolConfig::default().with_debug(true)).unwrap());
    for (kind, mem) in [
        (MbufKind::Normal, MemKind::DEVICE),
        (MbufKind::Dvpp, MemKind::Dvpp),
    ] {
        // 1 MiB is past the thread caches' largest footprint: the kind pool's free path.
        for (size, by_free) in [(100, false), (100, true), (1 << 20, false), (1 << 20, true)] {
            let buf = Mbuf::alloc(&pool, size, kind).unwrap();
            let copy = buf.clone();
            let (addr, size) = buf.data();
            // The padding starts at the region's length (header and data) rounded to 32.
            let at = addr + (HEADER_LEN + size).next_multiple_of(32) as usize - HEADER_LEN as usize;
            let junk = [0x55u8; 4];
            // SAFETY: 4 bytes inside the segment's padding (32 bytes past its rounded
            // length), in the pool's simulated device memory.
            unsafe {
                pool.source()
                    .memcpy(
                        at + 2,
                        4,
                        junk.as_ptr() as usize,
                        4,
                        MemcpyKind::HostToDevice,
                    )
                    .unwrap();
            }
            let what = format!("{kind:?} of {size}, by free: {by_free}");
            if by_free {
                assert_eq!(buf.free(), Ok(()), "{what}: a handle is left");
            } else {
                drop(buf);
            }
            assert!(
                pool.take_corruption_reports().is_empty(),
                "{what}: checked with the last handle, not before"
            );
            if by_free {
                let refused = copy.free();
                assert!(
                    matches!(refused, Err(Error::Corruption { kind: k, .. }) if k == mem),
                    "{what}: {refused:?}"
                );
            } else {
                drop(copy);
            }
            let reports = pool.take_corruption_reports();
            assert!(
                matches!(reports[..], [Error::Corruption { kind: k, .. }] if k == mem),
                "{what}: {reports:?}"
            );
            assert_eq!(
                pool.stats(mem).live_regions,
                0,
                "{what}: freed all the same"
            );
        }
    }
    pool.validate().unwrap();
}

/// `same_buffer` tells handles on one buffer from handles on another, as `refs` counts them.
#[test]
fn handles_tell_their_buffer_apart() {
    let pool = pool();
    let a = Mbuf::alloc(&pool, 64, MbufKind::Normal).unwrap();
    let b = Mbuf::alloc(&pool, 64, MbufKind::Normal).unwrap();
    let a2 = a.clone();
    assert!(a.same_buffer(&a2) && a2.same_buffer(&a));
    assert!(!a.same_buffer(&b));
    assert_eq!((a.refs(), b.refs()), (2, 1));
}
