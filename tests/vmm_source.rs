//! Virtual memory on the simulator: the AscendCL calls and their error codes, then
//! `VmmSource` growth, trim and rollback of failures half-way, and the pool over it.
//!
//! Tests that count memory objects hold `serial()`, so counts of other tests do not mix in.

#[path = "common/device.rs"]
mod common_device;

#[path = "common/memfd.rs"]
mod common_memfd;

#[path = "common/address_space.rs"]
mod address_space;

use std::sync::Arc;

use ascend_pool::source::sim::{AclFunc, Fault, FaultTimes, SimConfig, SimSource};
use ascend_pool::source::vmm::{PhysicalHandle, PhysicalMemProp, VmmConfig, VmmRuntime, VmmSource};
use ascend_pool::source::{Block, BlockSource, MemcpyKind};
use ascend_pool::{AclError, Error, MemKind, Pool, PoolConfig, Region};

const MIB: u64 = 1 << 20;
const G: u64 = 2 * MIB;

use common_memfd::{mapped_objects, memory_objects, serial};

fn sim(capacity: u64) -> Arc<SimSource> {
    Arc::new(SimSource::new(SimConfig::default().with_device_capacity(capacity)).unwrap())
}

fn code<T: std::fmt::Debug>(r: ascend_pool::Result<T>) -> (&'static str, AclError) {
    match r {
        Err(Error::Runtime { func, code }) => (func, code),
        other => panic!("expected a runtime error, got {other:?}"),
    }
}

fn used(sim: &SimSource) -> u64 {
    let (free, total) = sim.mem_info(0, MemKind::DEVICE).unwrap();
    total - free
}

use common_device::{read, write};

#[test]
fn vmm_calls_follow_the_documented_rules() {
    let _g = serial();
    let objects = memory_objects();
    let sim = sim(64 * MIB);
    let prop = PhysicalMemProp::device(0);
    let func = "aclrtMemGetAllocationGranularity";
    assert_eq!(
        sim.mem_get_allocation_granularity(Some(&prop), 0).unwrap(),
        G
    );
    assert_eq!(
        sim.mem_get_allocation_granularity(Some(&prop), 1).unwrap(),
        G
    );
    assert_eq!(
        code(sim.mem_get_allocation_granularity(None, 0)),
        (func, AclError::INVALID_PARAM)
    );
    assert_eq!(
        code(sim.mem_get_allocation_granularity(Some(&prop), 2)),
        (func, AclError::INVALID_PARAM)
    );
    let elsewhere = PhysicalMemProp::device(7);
    assert_eq!(
        code(sim.mem_get_allocation_granularity(Some(&elsewhere), 0)),
        (func, AclError::RT_PARAM_INVALID)
    );

    // Reservations: whole granules, alignment 0 (reserved), flags 0 or 1; no capacity used.
    let func = "aclrtReserveMemAddress";
    for (size, align, flags) in [
        (0, 0, 0),
        (G + 1, 0, 0),
        (G, G, 0),
        (G, 3 * G, 0),
        (G, 0, 2),
    ] {
        assert_eq!(
            code(sim.reserve_mem_address(size, align, 0, flags)),
            (func, AclError::INVALID_PARAM)
        );
    }
    let va = sim.reserve_mem_address(8 * G, 0, 0, 1).unwrap();
    assert_eq!(va as u64 % G, 0);
    assert_eq!(used(&sim), 0);

    // Physical memory: pinned device memory only, rounded up to the granule and counted.
    let func = "aclrtMallocPhysical";
    assert_eq!(
        code(sim.malloc_physical_with(G, Some(&prop), 1)),
        (func, AclError::INVALID_PARAM)
    );
    assert_eq!(
        code(sim.malloc_physical_with(0, Some(&prop), 0)),
        (func, AclError::INVALID_PARAM)
    );
    let posix = PhysicalMemProp {
        handle_type: 2,
        ..prop
    };
    assert_eq!(
        code(sim.malloc_physical_with(G, Some(&posix), 0)),
        (func, AclError::INVALID_PARAM)
    );
    let host = PhysicalMemProp {
        location_type: 0,
        ..prop
    };
    assert_eq!(
        code(sim.malloc_physical_with(G, Some(&host), 0)),
        (func, AclError::INVALID_PARAM)
    );
    let unknown = PhysicalMemProp {
        mem_attr: 18,
        ..prop
    };
    assert_eq!(
        code(sim.malloc_physical_with(G, Some(&unknown), 0)),
        (func, AclError::INVALID_PARAM)
    );
    assert_eq!(
        code(sim.mem_get_allocation_granularity(Some(&unknown), 0)),
        ("aclrtMemGetAllocationGranularity", AclError::INVALID_PARAM)
    );
    // `HUGE1G` memory comes in 1 GiB granules: one byte of it is more than this device has.
    let huge1g = PhysicalMemProp {
        mem_attr: 10,
        ..prop
    };
    assert_eq!(
        sim.mem_get_allocation_granularity(Some(&huge1g), 0)
            .unwrap(),
        1 << 30
    );
    assert_eq!(
        code(sim.malloc_physical_with(1, Some(&huge1g), 0)),
        (func, AclError::RT_MEMORY_ALLOCATION)
    );
    let a = sim.malloc_physical_with(G + 1, Some(&prop), 0).unwrap();
    assert_eq!(used(&sim), 2 * G);
    assert_eq!(
        code(sim.malloc_physical(0, 64 * MIB)),
        (func, AclError::RT_MEMORY_ALLOCATION)
    );
    let b = sim.malloc_physical(0, G).unwrap();
    assert_eq!(used(&sim), 3 * G);
    assert_eq!(memory_objects(), objects + 2);

    // Mappings: a whole object from offset 0 (the runtime takes no other), at whole
    // granules inside a reservation for its page type, not over another mapping.
    let func = "aclrtMapMem";
    let bogus = PhysicalHandle(usize::MAX);
    assert_eq!(
        code(sim.map_mem(va, 2 * G, 0, bogus, 0)),
        (func, AclError::RT_INVALID_HANDLE)
    );
    for (at, size, offset, flags) in [
        (va + 4096, 2 * G, 0, 0),
        (va, 2 * G + 4096, 0, 0),
        (va, 2 * G, 0, 1),
        (va, G, 0, 0),                      // part of `a`
        (va, G, G, 0),                      // its second granule
        (va + G as usize, G, G, 0),         // the same, elsewhere
        (va, 2 * G, G, 0),                  // past the end of `a`
        (va + 7 * G as usize, 2 * G, 0, 0), // past the end of the reservation
        (va - 2 * G as usize, 2 * G, 0, 0), // before it
    ] {
        assert_eq!(
            code(sim.map_mem(at, size, offset, a, flags)),
            (func, AclError::INVALID_PARAM),
            "{at:#x} {size} {offset}"
        );
    }
    // Huge-page memory goes only where huge pages were reserved.
    let normal_range = sim.reserve_mem_address(2 * G, 0, 0, 0).unwrap();
    assert_eq!(
        code(sim.map_mem(normal_range, 2 * G, 0, a, 0)),
        (func, AclError::INVALID_PARAM)
    );
    sim.release_mem_address(normal_range).unwrap();
    // `a` at granules 0..2, `b` right after: one device range.
    sim.map_mem(va, 2 * G, 0, a, 0).unwrap();
    sim.map_mem(va + 2 * G as usize, G, 0, b, 0).unwrap();
    assert_eq!(
        code(sim.map_mem(va + G as usize, G, 0, b, 0)),
        (func, AclError::INVALID_PARAM)
    );
    let data: Vec<u8> = (0..2 * G as usize).map(|i| (i % 251) as u8).collect();
    write(&*sim, va + G as usize / 2, &data); // crosses a granule and a mapping boundary
    assert_eq!(read(&*sim, va + G as usize / 2, data.len()), data);
    let s = sim.stats();
    assert_eq!(
        (
            s.reservations,
            s.physical_handles,
            s.mappings,
            s.live_blocks
        ),
        (1, 2, 2, 0)
    );

    // Not a block: aclrtFree refuses it; mapped memory cannot be freed; nor the reservation released.
    let block = ascend_pool::source::Block {
        addr: va,
        size: G,
        kind: MemKind::DEVICE,
        device: 0,
    };
    assert_eq!(
        code(sim.free_block(block)),
        ("aclrtFree", AclError::RT_MEMORY_FREE)
    );
    assert_eq!(
        code(sim.free_physical(a)),
        ("aclrtFreePhysical", AclError::RT_MEMORY_FREE)
    );
    assert_eq!(
        code(sim.release_mem_address(va)),
        ("aclrtReleaseMemAddress", AclError::INVALID_PARAM)
    );
    for inside in [va + 4096, va + G as usize] {
        assert_eq!(
            code(sim.unmap_mem(inside)),
            ("aclrtUnmapMem", AclError::INVALID_PARAM)
        );
    }

    for at in [va, va + 2 * G as usize] {
        sim.unmap_mem(at).unwrap();
    }
    assert_eq!(
        code(sim.unmap_mem(va)),
        ("aclrtUnmapMem", AclError::INVALID_PARAM)
    );
    // SAFETY: reading unmapped memory is refused before any byte moves.
    let r = unsafe { sim.memcpy(data.as_ptr() as usize, 16, va, 16, MemcpyKind::DeviceToHost) };
    assert_eq!(code(r), ("aclrtMemcpy", AclError::INVALID_PARAM));
    sim.free_physical(a).unwrap();
    sim.free_physical(b).unwrap();
    assert_eq!(
        code(sim.free_physical(a)),
        ("aclrtFreePhysical", AclError::RT_INVALID_HANDLE)
    );
    sim.release_mem_address(va).unwrap();
    assert_eq!(
        code(sim.release_mem_address(va)),
        ("aclrtReleaseMemAddress", AclError::INVALID_PARAM)
    );
    assert_eq!(used(&sim), 0);
    let s = sim.stats();
    assert_eq!((s.reservations, s.physical_handles, s.mappings), (0, 0, 0));
    assert_eq!(memory_objects(), objects);
}

/// A run of mappings may join physical memory of two devices. A device copy touching such a
/// run crosses devices, which the runtime does only once peer access is enabled (never, in
/// the simulator): it is refused even into memory of one of the two, while a copy within one
/// mapping, or out to the host, runs. The simulator copied across devices.
#[test]
fn a_device_copy_over_mappings_of_two_devices_is_refused() {
    let _g = serial();
    let config = SimConfig::default()
        .with_devices(2)
        .with_device_capacity(64 * MIB);
    let sim = SimSource::new(config).unwrap();
    // Flags 1: a range for the huge pages `malloc_physical` gives.
    let va = sim.reserve_mem_address(2 * G, 0, 0, 1).unwrap();
    let (p0, p1) = (
        sim.malloc_physical(0, G).unwrap(),
        sim.malloc_physical(1, G).unwrap(),
    );
    sim.map_mem(va, G, 0, p0, 0).unwrap();
    sim.map_mem(va + G as usize, G, 0, p1, 0).unwrap();
    let on0 = sim.alloc_block(0, MemKind::DEVICE, 2 * G).unwrap();
    let refused = ("aclrtMemcpy", AclError::INVALID_PARAM);
    let mut back = vec![0u8; 2 * G as usize];
    // SAFETY: every device range lies in the block or the two mappings, used by nothing
    // else; `back` holds `2 * G` bytes.
    unsafe {
        for kind in [MemcpyKind::DeviceToDevice, MemcpyKind::Default] {
            assert_eq!(code(sim.memcpy(on0.addr, 2 * G, va, 2 * G, kind)), refused);
            assert_eq!(code(sim.memcpy(va, 2 * G, on0.addr, 2 * G, kind)), refused);
            let on1 = va + G as usize;
            assert_eq!(code(sim.memcpy(on0.addr, G, on1, G, kind)), refused);
            sim.memcpy(on0.addr, G, va, G, kind).unwrap();
        }
        let to_host = MemcpyKind::DeviceToHost;
        sim.memcpy(back.as_mut_ptr() as usize, 2 * G, va, 2 * G, to_host)
            .unwrap();
    }
    sim.free_block(on0).unwrap();
    sim.unmap_mem(va).unwrap();
    sim.unmap_mem(va + G as usize).unwrap();
    sim.free_physical(p0).unwrap();
    sim.free_physical(p1).unwrap();
    sim.release_mem_address(va).unwrap();
    let s = sim.stats();
    assert_eq!((s.reservations, s.physical_handles, s.mappings), (0, 0, 0));
}

/// A reservation's flags name the pages mapped into it: normal-page memory goes only into
/// a range reserved with flags 0, huge-page memory only into one with flags 1, and memory
/// of both kinds (`ACL_HBM_MEM`) into either.
#[test]
fn memory_maps_only_into_a_range_reserved_for_its_pages() {
    let _g = serial();
    let sim = sim(64 * MIB);
    let with = |attr| PhysicalMemProp {
        mem_attr: attr,
        ..PhysicalMemProp::device(0)
    };
    let (normal, huge, both) = (5, 4, 1); // ACL_HBM_MEM_NORMAL, _HUGE, ACL_HBM_MEM
    for (flags, attr, fits) in [
        (0, normal, true),
        (0, huge, false),
        (0, both, true),
        (1, normal, false),
        (1, huge, true),
        (1, both, true),
    ] {
        let va = sim.reserve_mem_address(G, 0, 0, flags).unwrap();
        let h = sim.malloc_physical_with(G, Some(&with(attr)), 0).unwrap();
        let r = sim.map_mem(va, G, 0, h, 0);
        if fits {
            r.unwrap();
            sim.unmap_mem(va).unwrap();
        } else {
            assert_eq!(
                code(r),
                ("aclrtMapMem", AclError::INVALID_PARAM),
                "attribute {attr} into flags {flags}"
            );
        }
        sim.free_physical(h).unwrap();
        sim.release_mem_address(va).unwrap();
    }
    let s = sim.stats();
    assert_eq!((s.reservations, s.physical_handles, s.mappings), (0, 0, 0));
}

/// A reservation takes its own length of address space and no more, wherever it lands:
/// what was mapped to align it (to 1 GiB, for a range that long) is given back at once,
/// and releasing it gives back the rest.
#[test]
fn a_reservation_takes_only_its_own_address_space() {
    let sim = sim(64 * MIB);
    let len = 1 << 30;
    assert!(address_space::in_some_try(|| {
        let before = address_space::mapped_bytes();
        let va = sim.reserve_mem_address(len, 0, 0, 0).unwrap();
        let reserved = address_space::mapped_bytes() - before;
        assert_eq!(va % (1 << 30), 0);
        sim.release_mem_address(va).unwrap();
        let released = address_space::mapped_bytes() - before;
        (reserved, released) == (len as i64, 0)
    }));
}

/// `aclrtReserveMemAddress` lands at the address asked for when it is free and aligned,
/// and elsewhere (aligned) when it is not.
#[test]
fn a_reservation_lands_where_asked_when_it_can() {
    let sim = sim(64 * MIB);
    let align = G; // the granularity, for ranges under 1 GiB
                   // The bottom of a range just given back: free, and not where the kernel would place a
                   // reservation of its own choice (the top of the free range). Another thread of this
                   // binary may map something there meanwhile, so try a few times.
    let landed = address_space::in_some_try(|| {
        let room = sim.reserve_mem_address(64 * G, 0, 0, 0).unwrap();
        sim.release_mem_address(room).unwrap();
        let va = sim.reserve_mem_address(4 * G, 0, room, 0).unwrap();
        sim.release_mem_address(va).unwrap();
        va == room
    });
    assert!(landed, "a free, aligned address asked for was not used");
    // Taken: the second reservation goes elsewhere, still aligned.
    let va = sim.reserve_mem_address(4 * G, 0, 0, 0).unwrap();
    let other = sim.reserve_mem_address(4 * G, 0, va, 0).unwrap();
    assert_ne!(other, va);
    assert_eq!(other % align as usize, 0);
    // Misaligned: not used even where it is free.
    let room = sim.reserve_mem_address(64 * G, 0, 0, 0).unwrap();
    sim.release_mem_address(room).unwrap();
    let third = sim.reserve_mem_address(4 * G, 0, room + 4096, 0).unwrap();
    assert_eq!(third % align as usize, 0);
    for v in [va, other, third] {
        sim.release_mem_address(v).unwrap();
    }
}

#[test]
fn unmap_waits_for_queued_copies() {
    let _g = serial();
    let sim = sim(64 * MIB);
    let va = sim.reserve_address(0, G).unwrap();
    let h = sim.malloc_physical(0, G).unwrap();
    sim.map(va, G, 0, h).unwrap();
    let stream = sim.create_stream(0).unwrap();
    let hold = sim.hold_stream(stream).unwrap();
    // SAFETY: the mapping is live; the unmap below waits for this fill to run.
    unsafe { sim.memset_async(va, G, 1, G, stream).unwrap() };
    let unmapper = {
        let sim = Arc::clone(&sim);
        std::thread::spawn(move || sim.unmap(va))
    };
    std::thread::sleep(std::time::Duration::from_millis(30));
    assert!(!unmapper.is_finished(), "unmapped under a queued fill");
    hold.release();
    unmapper.join().unwrap().unwrap();
    sim.free_physical(h).unwrap();
    sim.release_address(va).unwrap();
    sim.destroy_stream(stream).unwrap();
}

fn vmm(capacity: u64) -> (Arc<SimSource>, VmmSource<SimSource>) {
    let sim = sim(capacity);
    let vmm = VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default()).unwrap();
    (sim, vmm)
}

/// A block of four granules mapped as three physical allocations, one growth after another:
/// granules [0], [1] and [2, 3].
fn three_extent_block(vmm: &VmmSource<SimSource>) -> ascend_pool::source::Block {
    let a = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    let a = vmm.extend_block(a, G).unwrap().unwrap();
    let a = vmm.extend_block(a, 2 * G).unwrap().unwrap();
    assert_eq!(vmm.stats().extents, 3);
    a
}

#[test]
fn blocks_grow_in_place_and_give_their_tail_back() {
    let _g = serial();
    let objects = memory_objects();
    let (sim, vmm) = vmm(64 * MIB);
    let (base, reserved) = vmm.reservation();
    assert_eq!(reserved, 256 * MIB, "4x the device by default");
    let a = vmm.alloc_block(0, MemKind::DEVICE, 3 * MIB).unwrap();
    assert_eq!(a.addr, base);
    assert_eq!(used(&sim), 2 * G);
    write(&vmm, a.addr + 3 * MIB as usize - 8, b"old tail");

    // Growth maps new granules right after the block: same address, data kept.
    let a = vmm.extend_block(a, 5 * MIB).unwrap().unwrap();
    assert_eq!((a.addr, a.size), (base, 8 * MIB));
    assert_eq!(read(&vmm, a.addr + 3 * MIB as usize - 8, 8), b"old tail");
    write(&vmm, a.addr + 8 * MIB as usize - 8, b"new tail");
    assert_eq!(used(&sim), 4 * G);
    // Growth within the mapped granules maps nothing.
    // A new block goes half-way into the free addresses after `a`, so both can grow.
    let b = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    let room = (b.addr - (base + 8 * MIB as usize)) as u64;
    assert_eq!(room, (reserved - 8 * MIB - G) / 2 / G * G);
    // `a` grows up to its neighbour, never past it.
    assert!(vmm.extend_block(a, room + G).unwrap().is_none());
    vmm.validate().unwrap();

    // Shrinking gives back the extent the growth mapped, not the first one, which
    // straddles the new end: its bytes stay mapped, and the block keeps them as its size.
    let a = vmm.shrink_block(a, 2 * MIB).unwrap();
    assert_eq!(a.size, 4 * MIB);
    assert_eq!(used(&sim), 3 * G);
    assert_eq!(vmm.stats().extents, 2);
    assert_eq!(read(&vmm, a.addr, 1).len(), 1);
    vmm.validate().unwrap();
    // A block of another size or kind, or one never handed out, is refused.
    let wrong = ascend_pool::source::Block { size: 3 * MIB, ..a };
    assert_eq!(
        code(vmm.free_block(wrong)),
        ("aclrtUnmapMem", AclError::INVALID_PARAM)
    );
    let never = ascend_pool::source::Block {
        addr: base + 64 * MIB as usize,
        ..a
    };
    assert_eq!(
        code(vmm.free_block(never)),
        ("aclrtUnmapMem", AclError::RT_MEMORY_FREE)
    );
    vmm.free_block(a).unwrap();
    vmm.free_block(b).unwrap();
    assert_eq!(
        code(vmm.free_block(b)),
        ("aclrtUnmapMem", AclError::RT_MEMORY_FREE)
    );
    assert_eq!(used(&sim), 0);
    assert_eq!(vmm.stats(), Default::default());
    // DVPP and host memory go straight to the runtime.
    let d = vmm.alloc_block(0, MemKind::Dvpp, 1000).unwrap();
    assert!(sim.block_containing(d.addr).is_some());
    assert!(vmm.extend_block(d, 10).unwrap().is_none());
    vmm.free_block(d).unwrap();
    drop(vmm);
    let s = sim.stats();
    assert_eq!((s.reservations, s.physical_handles, s.mappings), (0, 0, 0));
    assert_eq!(memory_objects(), objects);
}

#[test]
fn a_failed_growth_leaves_the_source_as_it_was() {
    let _g = serial();
    let (sim, vmm) = vmm(64 * MIB);
    let a = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    write(&vmm, a.addr, b"kept");
    let before = (
        sim.stats().mappings,
        sim.stats().physical_handles,
        used(&sim),
        vmm.stats(),
    );

    // The growth's one mapping (of four granules) fails: nothing is mapped, the memory freed.
    sim.inject_fault(Fault::next(
        AclFunc::MapMem,
        AclError::RT_MEMORY_ALLOCATION,
        1,
    ));
    assert_eq!(
        code(vmm.extend_block(a, 4 * G)),
        ("aclrtMapMem", AclError::RT_MEMORY_ALLOCATION)
    );
    assert_eq!(
        (
            sim.stats().mappings,
            sim.stats().physical_handles,
            used(&sim),
            vmm.stats()
        ),
        before
    );
    assert_eq!(sim.stats().failures(AclFunc::MapMem), 1);
    assert_eq!(sim.stats().calls(AclFunc::UnmapMem), 0);
    vmm.validate().unwrap();
    // The same for a new block, and when the physical allocation itself fails.
    sim.inject_fault(Fault::next(
        AclFunc::MapMem,
        AclError::RT_MEMORY_ALLOCATION,
        1,
    ));
    assert!(vmm.alloc_block(0, MemKind::DEVICE, 3 * G).is_err());
    sim.inject_fault(Fault::out_of_memory(AclFunc::MallocPhysical));
    let e = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap_err();
    assert!(matches!(e, Error::Runtime { code, .. } if code.is_out_of_memory()));
    assert_eq!(
        (
            sim.stats().mappings,
            sim.stats().physical_handles,
            used(&sim),
            vmm.stats()
        ),
        before
    );

    // Nothing was lost: the growth works once the fault is spent, and the data is there.
    let a = vmm.extend_block(a, 4 * G).unwrap().unwrap();
    assert_eq!(read(&vmm, a.addr, 4), b"kept");
    assert_eq!(used(&sim), 5 * G);

    // An unmap that fails while freeing (the second extent's) maps the first back: the
    // block is whole and usable.
    sim.inject_fault(Fault::after(AclFunc::UnmapMem, AclError::RT_FAILURE, 1));
    assert_eq!(
        code(vmm.free_block(a)),
        ("aclrtUnmapMem", AclError::RT_FAILURE)
    );
    assert_eq!(read(&vmm, a.addr, 4), b"kept");
    write(&vmm, a.addr + 5 * G as usize - 4, b"tail");
    vmm.validate().unwrap();
    // A physical free that fails is retried later, with nothing left mapped meanwhile.
    sim.inject_fault(Fault::next(AclFunc::FreePhysical, AclError::RT_FAILURE, 2));
    vmm.free_block(a).unwrap();
    assert_eq!(vmm.stats().orphans, 2);
    assert_eq!(sim.stats().mappings, 0);
    let b = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    assert_eq!(vmm.stats().orphans, 0);
    vmm.free_block(b).unwrap();
    assert_eq!(used(&sim), 0);
    vmm.validate().unwrap();

    // A failed mapping whose memory cannot be freed either leaves nothing mapped behind:
    // the addresses take the next block, and the memory is freed on the next growth.
    sim.inject_fault(Fault::next(AclFunc::MapMem, AclError::RT_FAILURE, 1));
    sim.inject_fault(Fault::next(AclFunc::FreePhysical, AclError::RT_FAILURE, 1));
    assert_eq!(
        code(vmm.alloc_block(0, MemKind::DEVICE, 2 * G)),
        ("aclrtMapMem", AclError::RT_FAILURE)
    );
    assert_eq!((vmm.stats().orphans, sim.stats().mappings), (1, 0));
    let c = vmm.alloc_block(0, MemKind::DEVICE, 2 * G).unwrap();
    assert_eq!(vmm.stats().orphans, 0);
    write(&vmm, c.addr + 2 * G as usize - 4, b"last");
    vmm.free_block(c).unwrap();
    assert_eq!(used(&sim), 0);
    vmm.validate().unwrap();
}

/// A block of several granules is one physical allocation, mapped whole by one call from
/// offset 0: the runtime maps no part of an allocation and no offset but 0.
#[test]
fn a_block_of_several_granules_is_one_mapping() {
    let _g = serial();
    let (sim, vmm) = vmm(64 * MIB);
    let maps = sim.stats().calls(AclFunc::MapMem);
    let a = vmm.alloc_block(0, MemKind::DEVICE, 3 * G).unwrap();
    assert_eq!(sim.stats().calls(AclFunc::MapMem), maps + 1);
    assert_eq!((sim.stats().mappings, vmm.stats().extents), (1, 1));
    let a = vmm.extend_block(a, 2 * G).unwrap().unwrap();
    assert_eq!(sim.stats().calls(AclFunc::MapMem), maps + 2);
    write(&vmm, a.addr + 3 * G as usize - 2, b"join"); // across the two mappings
    assert_eq!(read(&vmm, a.addr + 3 * G as usize - 2, 4), b"join");
    let unmaps = sim.stats().calls(AclFunc::UnmapMem);
    vmm.free_block(a).unwrap();
    assert_eq!(sim.stats().calls(AclFunc::UnmapMem), unmaps + 2);
    assert_eq!(sim.stats().failures(AclFunc::MapMem), 0);
}

#[test]
fn large_requests_find_contiguous_addresses_among_scattered_free_memory() {
    let _g = serial();
    let (sim, vmm) = vmm(64 * MIB);
    let blocks: Vec<_> = (0..8)
        .map(|_| vmm.alloc_block(0, MemKind::DEVICE, 8 * MIB).unwrap())
        .collect();
    assert_eq!(
        code(vmm.alloc_block(0, MemKind::DEVICE, G)).1,
        AclError::RT_MEMORY_ALLOCATION
    );
    // Free every other block: 32 MiB free, in 8 MiB holes.
    for b in blocks.iter().step_by(2) {
        vmm.free_block(*b).unwrap();
    }
    let big = vmm.alloc_block(0, MemKind::DEVICE, 32 * MIB).unwrap();
    let data = vec![0x5Au8; 32 * MIB as usize];
    write(&vmm, big.addr, &data);
    assert_eq!(read(&vmm, big.addr, data.len()), data);
    assert_eq!(used(&sim), 64 * MIB);
    vmm.validate().unwrap();
}

#[test]
fn a_pool_over_the_vmm_source_maps_its_device_chunks() {
    let _g = serial();
    let objects = memory_objects();
    let (sim, vmm) = vmm(256 * MIB);
    let (base, reserved) = vmm.reservation();
    let vmm = Arc::new(vmm);
    let pool = Pool::new(vmm.clone(), PoolConfig::default()).unwrap();
    let mut regions = Vec::new();
    for i in 0..40u64 {
        let mut r = pool.alloc_device(8 + i * 100_000).unwrap();
        assert!(r.addr() >= base && r.addr() < base + reserved as usize);
        pool.copy_from_host(&mut r, 0, &i.to_le_bytes()).unwrap();
        regions.push(r);
    }
    assert!(sim.stats().mappings > 0);
    assert_eq!(
        sim.stats().live_blocks,
        0,
        "no device block came from aclrtMalloc"
    );
    for (i, r) in regions.iter().enumerate() {
        let mut b = [0u8; 8];
        pool.copy_to_host(r, 0, &mut b).unwrap();
        assert_eq!(u64::from_le_bytes(b), i as u64);
    }
    drop(regions);
    pool.trim();
    assert_eq!(vmm.stats().mapped_bytes, 0);
    drop(pool);
    drop(vmm);
    assert_eq!(used(&sim), 0);
    assert_eq!(memory_objects(), objects);
}

/// A pool over `vmm` with small (4 MiB) chunks and no dedicated chunk below 64 MiB, so a
/// request past a chunk's free tail grows the chunk in place.
fn pool_growing_in_place(vmm: &Arc<VmmSource<SimSource>>) -> Pool {
    let mut config = PoolConfig::default().with_chunk_size(4 * MIB);
    config.large_threshold = 64 * MIB;
    Pool::new(vmm.clone(), config).unwrap()
}

#[test]
fn the_pool_grows_a_chunk_in_place_and_trims_its_tail() {
    let _g = serial();
    let (sim, vmm) = vmm(256 * MIB);
    let vmm = Arc::new(vmm);
    let pool = pool_growing_in_place(&vmm);
    let mut regions = Vec::new();
    for i in 0..5u8 {
        let mut r = pool.alloc_device(3 * MIB).unwrap();
        pool.copy_from_host(&mut r, 0, &[i; 64]).unwrap();
        regions.push(r);
    }
    let st = pool.stats(MemKind::DEVICE);
    // One chunk, grown where it is: the regions follow each other in one address range.
    assert_eq!(st.chunks, 1, "{st:?}");
    assert!(st.reserved_bytes >= 15 * MIB);
    let (base, _) = vmm.reservation();
    for r in &regions {
        assert!(
            r.addr() >= base && r.addr() + 3 * MIB as usize <= base + st.reserved_bytes as usize
        );
    }
    // A request larger than what any fresh chunk would be served the same way.
    let big = pool.alloc_device(20 * MIB).unwrap();
    assert_eq!(pool.stats(MemKind::DEVICE).chunks, 1);
    // The grown engine carves the whole grown block, to the last byte.
    let snap = pool.snapshot();
    let chunk = &snap.kinds[0].chunks[0];
    assert_eq!(chunk.engine.range.capacity, chunk.size);
    assert_eq!(chunk.size, pool.stats(MemKind::DEVICE).reserved_bytes);
    drop(big);
    let before = pool.stats(MemKind::DEVICE).reserved_bytes;
    let used_before = used(&sim);
    // The tail is free again: trim unmaps it, keeps the chunk and the regions in it.
    regions.truncate(2);
    let released = pool.trim();
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(st.chunks, 1);
    assert!(
        released > 0 && st.reserved_bytes == before - released,
        "{released} {st:?}"
    );
    assert!(used(&sim) < used_before);
    for (i, r) in regions.iter().enumerate() {
        let mut b = [0u8; 64];
        pool.copy_to_host(r, 0, &mut b).unwrap();
        assert_eq!(b, [i as u8; 64]);
    }
    pool.validate().unwrap();
    vmm.validate().unwrap();
    // And it grows again after the trim.
    regions.push(pool.alloc_device(10 * MIB).unwrap());
    assert_eq!(pool.stats(MemKind::DEVICE).chunks, 1);
    pool.validate().unwrap();
}

/// `source_alloc_calls` counts every request for memory the source answered, growth in
/// place included, served or refused (as a refused new block counts); `source_free_calls`
/// every return of memory, a tail given back in place included: trim gave bytes back, and
/// the figures said no call had.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn source_calls_count_growth_in_place_refused_or_not_and_tails_given_back() {
    let _g = serial();
    let (sim, vmm) = vmm(256 * MIB);
    let vmm = Arc::new(vmm);
    let pool = pool_growing_in_place(&vmm);
    let first = pool.alloc_device(3 * MIB).unwrap();
    let before = pool.stats(MemKind::DEVICE);
    let physical = || sim.stats().calls(AclFunc::MallocPhysical);
    let asked = physical();
    // Out of memory once: the pool asks again and the chunk grows where it is.
    sim.inject_fault(Fault::next(
        AclFunc::MallocPhysical,
        AclError::RT_MEMORY_ALLOCATION,
        1,
    ));
    let second = pool.alloc_device(3 * MIB).unwrap();
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(physical() - asked, 2, "one refused extension, one served");
    assert_eq!(
        (st.chunks, st.source_alloc_calls),
        (1, before.source_alloc_calls + 2),
        "{st:?}"
    );
    // The grown tail goes back on trim, the chunk stays: one call giving memory back.
    drop(second);
    let released = pool.trim();
    let st = pool.stats(MemKind::DEVICE);
    assert!(released > 0 && st.chunks == 1, "{released} {st:?}");
    assert_eq!(st.source_free_calls, before.source_free_calls + 1, "{st:?}");
    drop(first);
    pool.validate().unwrap();
    vmm.validate().unwrap();
}

#[test]
fn a_growth_in_place_the_runtime_refuses_for_a_reason_other_than_memory_is_an_error() {
    let _g = serial();
    let (sim, vmm) = vmm(256 * MIB);
    let vmm = Arc::new(vmm);
    let pool = pool_growing_in_place(&vmm);
    let first = pool.alloc_device(3 * MIB).unwrap();
    let before = pool.stats(MemKind::DEVICE);
    // Out of memory, the pool tries a fresh chunk; any other refusal is the caller's.
    sim.inject_fault(Fault::next(AclFunc::MapMem, AclError::RT_FAILURE, 1));
    assert_eq!(
        code(pool.alloc_device(3 * MIB)),
        ("aclrtMapMem", AclError::RT_FAILURE)
    );
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (st.chunks, st.reserved_bytes, st.live_regions),
        (before.chunks, before.reserved_bytes, 1)
    );
    // The refused extension was a call to the source, as a refused new block is.
    assert_eq!(st.source_alloc_calls, before.source_alloc_calls + 1);
    pool.validate().unwrap();
    vmm.validate().unwrap();
    // The fault spent, the same request grows the chunk in place.
    let second = pool.alloc_device(3 * MIB).unwrap();
    let st = pool.stats(MemKind::DEVICE);
    // An extension is a call to the source like a new block.
    assert_eq!(
        (st.chunks, st.source_alloc_calls),
        (1, before.source_alloc_calls + 2)
    );
    drop((first, second));
    pool.validate().unwrap();
}

#[test]
fn blocks_taken_one_after_another_can_all_grow_in_place() {
    let _g = serial();
    let (_sim, vmm) = vmm(64 * MIB);
    // Pools of three kinds, each growing its one chunk as it goes (as the pool does under
    // virtual memory): every block keeps free addresses after it.
    let mut blocks: Vec<_> = (0..3)
        .map(|_| vmm.alloc_block(0, MemKind::DEVICE, G).unwrap())
        .collect();
    for _ in 0..4 {
        for b in &mut blocks {
            let addr = b.addr;
            *b = vmm
                .extend_block(*b, G)
                .unwrap()
                .expect("room after every block");
            assert_eq!(b.addr, addr);
        }
    }
    vmm.validate().unwrap();
    for b in blocks {
        assert_eq!(b.size, 5 * G);
        vmm.free_block(b).unwrap();
    }
    assert_eq!(vmm.stats(), Default::default());
}

/// A chunk made for an over-aligned request starts past its block's address; grown in
/// place, its engine still ends where the block ends, not past it.
#[test]
fn an_over_aligned_chunk_grows_in_place_within_its_block() {
    let _g = serial();
    let align = 8 * MIB;
    // A reservation under 1 GiB is only granule-aligned, so one in four starts 8 MiB-aligned
    // and its chunk skips nothing: take the first that does not (the kernel places each
    // elsewhere).
    let mut aligned = Vec::new();
    let vmm = loop {
        let config = VmmConfig::default().with_reserve((1 << 30) - 3 * G);
        let vmm = VmmSource::new(sim(256 * MIB), 0, config).unwrap();
        if vmm.reservation().0 % align as usize != 0 {
            break vmm;
        }
        assert!(aligned.len() < 64, "every reservation starts 8 MiB-aligned");
        aligned.push(vmm);
    };
    drop(aligned);
    let vmm = Arc::new(vmm);
    let pool = pool_growing_in_place(&vmm);
    let mut regions = Vec::new();
    for _ in 0..4 {
        let r = pool.alloc_device_aligned(3 * MIB, align).unwrap();
        assert_eq!(r.addr() % align as usize, 0);
        regions.push(r);
        pool.validate().unwrap();
    }
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(st.chunks, 1, "one chunk, grown where it is: {st:?}");
    assert!(st.source_alloc_calls > 1, "{st:?}");
    let snap = pool.snapshot();
    let chunk = &snap.kinds[0].chunks[0];
    // The engine starts at the first aligned address in the block, and stops at its end.
    let skipped = chunk.addr.next_multiple_of(align as usize) - chunk.addr;
    assert!(skipped > 0, "the block's own start is not aligned enough");
    assert_eq!(chunk.engine.range.capacity, chunk.size - skipped as u64);
    vmm.validate().unwrap();
}

/// A trim the runtime refuses (the unmap fails) keeps the chunk's tail: the block stays as
/// it was, and the engine takes the tail back and carves it again without the source.
#[test]
fn a_trim_the_runtime_refuses_keeps_the_tail_carvable() {
    let _g = serial();
    let (sim, vmm) = vmm(256 * MIB);
    let vmm = Arc::new(vmm);
    let pool = pool_growing_in_place(&vmm);
    let mut regions: Vec<_> = (0..5)
        .map(|_| pool.alloc_device(3 * MIB).unwrap())
        .collect();
    regions.truncate(2);
    let before = pool.stats(MemKind::DEVICE);
    assert_eq!(before.chunks, 1);
    sim.inject_fault(Fault::next(AclFunc::UnmapMem, AclError::RT_FAILURE, 1));
    assert_eq!(pool.trim(), 0, "nothing went back");
    assert_eq!(
        sim.stats().failures(AclFunc::UnmapMem),
        1,
        "the unmap was tried"
    );
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(st.reserved_bytes, before.reserved_bytes);
    let snap = pool.snapshot();
    let chunk = &snap.kinds[0].chunks[0];
    assert_eq!(
        chunk.engine.range.capacity, chunk.size,
        "the tail is the engine's again"
    );
    pool.validate().unwrap();
    vmm.validate().unwrap();
    // The tail serves the same requests again, without a call to the source.
    regions.extend((0..3).map(|_| pool.alloc_device(3 * MIB).unwrap()));
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (st.chunks, st.source_alloc_calls, st.reserved_bytes),
        (1, before.source_alloc_calls, before.reserved_bytes)
    );
    pool.validate().unwrap();
}

/// A block goes in the largest free range of addresses (the first of equal ones), half-way
/// into it; a request no free range holds is refused before anything is mapped. A block
/// grows up to its neighbour exactly, and within its mapped granules without mapping.
#[test]
fn blocks_go_in_the_largest_free_range_and_grow_up_to_their_neighbour() {
    let _g = serial();
    let sim = sim(256 * MIB);
    let config = VmmConfig::default().with_reserve(256 * MIB);
    let vmm = VmmSource::new(Arc::clone(&sim), 0, config).unwrap();
    let (base, reserved) = vmm.reservation();
    assert_eq!(
        reserved,
        256 * MIB,
        "the reservation asked for, not 4x the device"
    );
    assert_eq!((vmm.device(), vmm.granule()), (0, G));
    assert_eq!(vmm.name(), "vmm:sim");
    let two = SimConfig::default().with_devices(2);
    let on_1 = VmmSource::new(
        Arc::new(SimSource::new(two).unwrap()),
        1,
        VmmConfig::default(),
    );
    assert_eq!(on_1.unwrap().device(), 1);
    let at = |mib: usize| base + (mib << 20);
    let a = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    assert_eq!(a.addr, at(0), "the start of the reservation as it is");
    let b = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    assert_eq!(b.addr, at(128), "half-way into 2..256 MiB");
    // Two free ranges of 126 MiB: the first.
    let c = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    assert_eq!(c.addr, at(64));
    // 62, 62 and 126 MiB: the largest, though the first two come before it.
    let d = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    assert_eq!(d.addr, at(192));
    vmm.validate().unwrap();
    // Four free ranges of 62 MiB: 64 MiB fits in none, though the device has it.
    let before = (used(&sim), sim.stats().calls(AclFunc::MallocPhysical));
    assert_eq!(
        code(vmm.alloc_block(0, MemKind::DEVICE, 64 * MIB)),
        ("aclrtReserveMemAddress", AclError::RT_MEMORY_ALLOCATION)
    );
    assert_eq!(
        (used(&sim), sim.stats().calls(AclFunc::MallocPhysical)),
        before
    );
    // `c` (64..66 MiB) grows up to `b` at 128 MiB exactly, and not a granule further.
    assert!(vmm.extend_block(c, 62 * MIB + G).unwrap().is_none());
    let c = vmm
        .extend_block(c, 62 * MIB)
        .unwrap()
        .expect("room up to b");
    assert_eq!((c.addr, c.size), (at(64), 64 * MIB));
    // A block of 3 MiB has 4 MiB mapped: one more MiB maps nothing.
    let e = vmm.alloc_block(0, MemKind::DEVICE, 3 * MIB).unwrap();
    let maps = sim.stats().calls(AclFunc::MapMem);
    let e = vmm
        .extend_block(e, MIB)
        .unwrap()
        .expect("room in its own granules");
    assert_eq!(e.size, 4 * MIB);
    assert_eq!(sim.stats().calls(AclFunc::MapMem), maps);
    vmm.validate().unwrap();
    for blk in [a, b, c, d, e] {
        vmm.free_block(blk).unwrap();
    }
    assert_eq!(used(&sim), 0);
}

/// Shrinking to a size not smaller, or a block of a kind the source does not map, changes
/// nothing.
#[test]
fn shrinks_that_shrink_nothing_change_nothing() {
    let _g = serial();
    let (sim, vmm) = vmm(64 * MIB);
    let d = vmm.alloc_block(0, MemKind::DEVICE, 3 * MIB).unwrap();
    for size in [3 * MIB, 3 * MIB + 1, 8 * MIB] {
        assert_eq!(vmm.shrink_block(d, size).unwrap(), d);
    }
    assert_eq!(used(&sim), 2 * G);
    let h = vmm.alloc_block(0, MemKind::Host, 3 * MIB).unwrap();
    assert_eq!(vmm.shrink_block(h, MIB).unwrap(), h);
    vmm.validate().unwrap();
    vmm.free_block(h).unwrap();
    vmm.free_block(d).unwrap();
    assert_eq!(vmm.stats(), Default::default());
    // A freed block is refused, even with nothing to cut (it used to come back Ok).
    assert!(matches!(
        vmm.shrink_block(d, 8 * MIB),
        Err(Error::Runtime { .. })
    ));
}

/// A shrink whose second unmap fails maps the extent already unmapped back where it was:
/// the data under every address is as it was.
#[test]
fn a_shrink_refused_half_way_maps_each_extent_back_where_it_was() {
    let _g = serial();
    let (sim, vmm) = vmm(64 * MIB);
    let a = three_extent_block(&vmm);
    let granule = |k: u64| a.addr + (k * G) as usize;
    for k in 0..4u8 {
        write(&vmm, granule(k as u64), &[k + 1; 8]);
    }
    sim.inject_fault(Fault::after(AclFunc::UnmapMem, AclError::RT_FAILURE, 1));
    assert_eq!(
        code(vmm.shrink_block(a, G)),
        ("aclrtUnmapMem", AclError::RT_FAILURE)
    );
    for k in 0..4u8 {
        assert_eq!(read(&vmm, granule(k as u64), 8), [k + 1; 8], "granule {k}");
    }
    assert_eq!(used(&sim), 4 * G);
    vmm.validate().unwrap();
    let a = vmm.shrink_block(a, G).unwrap();
    assert_eq!(used(&sim), G);
    vmm.free_block(a).unwrap();
}

/// An extent that cannot be mapped back after a refused unmap is no longer mapped: the
/// source's table says so, a free goes on without it and a shrink keeps what is still
/// mapped (the table named a mapping the runtime no longer had, and every later free of the
/// block was refused as an unknown mapping).
#[test]
fn an_extent_that_cannot_be_mapped_back_leaves_the_table() {
    let _g = serial();
    let (sim, vmm) = vmm(64 * MIB);
    let a = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    let a = vmm.extend_block(a, G).unwrap().unwrap();
    write(&vmm, a.addr, b"head");
    sim.inject_fault(Fault::after(AclFunc::UnmapMem, AclError::RT_FAILURE, 1));
    sim.inject_fault(Fault::next(AclFunc::MapMem, AclError::RT_FAILURE, 1));
    let freed = vmm.free_block(a);
    assert_eq!(vmm.stats().extents, sim.stats().mappings);
    freed.unwrap();
    assert_eq!(
        (
            sim.stats().mappings,
            sim.stats().physical_handles,
            used(&sim)
        ),
        (0, 0, 0)
    );
    assert_eq!(vmm.stats(), Default::default());
    vmm.validate().unwrap();

    // The shrink to one granule unmaps [2, 3], is refused on [1], and [2, 3] cannot be
    // mapped back.
    let a = three_extent_block(&vmm);
    write(&vmm, a.addr + G as usize, b"kept");
    sim.inject_fault(Fault::after(AclFunc::UnmapMem, AclError::RT_FAILURE, 1));
    sim.inject_fault(Fault::next(AclFunc::MapMem, AclError::RT_FAILURE, 1));
    let shrunk = vmm.shrink_block(a, G);
    assert_eq!(vmm.stats().extents, sim.stats().mappings);
    let a = shrunk.unwrap();
    // What stays mapped is the holder's, and counted as the block's size.
    assert_eq!(a.size, 2 * G);
    assert_eq!((vmm.stats().mapped_bytes, used(&sim)), (2 * G, 2 * G));
    assert_eq!(read(&vmm, a.addr + G as usize, 4), b"kept");
    vmm.validate().unwrap();
    vmm.free_block(a).unwrap();
    assert_eq!(used(&sim), 0);
}

/// A free that loses its tail (an unmap refused, the extent after it not mapped back) and is
/// then refused again keeps the block with its holder, who may carve it again (a pool keeps
/// a chunk whose free failed): the block is mapped whole, on new memory under the lost tail.
/// It used to stay short of its size, unmapped past the lost extent, and `validate` failed.
#[test]
fn a_free_refused_after_losing_its_tail_leaves_the_block_whole() {
    let _g = serial();
    let (sim, vmm) = vmm(64 * MIB);
    let a = three_extent_block(&vmm);
    write(&vmm, a.addr, b"head");
    // [2, 3] is unmapped, [1] refused and [2, 3] not mapped back; the free goes on with
    // what is still mapped, and [1] is refused again.
    sim.inject_fault(Fault {
        func: AclFunc::UnmapMem,
        code: AclError::RT_FAILURE,
        times: FaultTimes::After { skip: 1, n: 2 },
    });
    sim.inject_fault(Fault::next(AclFunc::MapMem, AclError::RT_FAILURE, 1));
    assert_eq!(
        code(vmm.free_block(a)),
        ("aclrtUnmapMem", AclError::RT_FAILURE)
    );
    vmm.validate().unwrap();
    assert_eq!(vmm.stats().extents, sim.stats().mappings);
    assert_eq!((vmm.stats().mapped_bytes, used(&sim)), (4 * G, 4 * G));
    assert_eq!(read(&vmm, a.addr, 4), b"head");
    write(&vmm, a.addr + 4 * G as usize - 4, b"tail");
    vmm.free_block(a).unwrap();
    assert_eq!((used(&sim), sim.stats().mappings), (0, 0));
    assert_eq!(vmm.stats(), Default::default());
}

/// Four refusals in a row on the free of `a` (a block of three extents): [2, 3] is
/// unmapped, [1] refused and [2, 3] not mapped back; [1] is refused again, and so is the map
/// of new memory under the lost [2, 3]. [0] and [1] stay mapped.
fn free_refused_four_times(sim: &SimSource, vmm: &VmmSource<SimSource>, a: Block) {
    sim.inject_fault(Fault {
        func: AclFunc::UnmapMem,
        code: AclError::RT_FAILURE,
        times: FaultTimes::After { skip: 1, n: 2 },
    });
    sim.inject_fault(Fault::next(AclFunc::MapMem, AclError::RT_FAILURE, 2));
    let freed = vmm.free_block(a);
    assert_eq!(
        sim.stats().failures(AclFunc::MapMem),
        2,
        "the new tail was tried"
    );
    vmm.validate().unwrap();
    freed.unwrap();
}

/// A free refused four times in a row leaves a block its source cannot make whole (its tail
/// is unmapped): the source retires it. The free counts as done, the block is refused as
/// freed from then on, no block is placed over what it still maps, and a later call gives
/// that memory back. The block used to stay with its holder, short of its size (a pool
/// carved it again, over unmapped addresses), and `validate` failed.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_free_refused_four_times_retires_the_block() {
    let _g = serial();
    let (sim, vmm) = vmm(64 * MIB);
    let a = three_extent_block(&vmm);
    free_refused_four_times(&sim, &vmm, a);
    let st = vmm.stats();
    assert_eq!(
        (st.blocks, st.retired, st.extents, st.mapped_bytes),
        (0, 1, 2, 2 * G)
    );
    assert_eq!(
        (sim.stats().mappings, used(&sim)),
        (st.extents, st.mapped_bytes)
    );
    // Freed: refused as a block freed already, as it was handed out and as it is now.
    for block in [a, Block { size: 2 * G, ..a }] {
        assert_eq!(
            code(vmm.free_block(block)),
            ("aclrtUnmapMem", AclError::RT_MEMORY_FREE)
        );
        assert_eq!(
            code(vmm.extend_block(block, G)),
            ("aclrtMapMem", AclError::RT_MEMORY_FREE)
        );
        assert_eq!(
            code(vmm.shrink_block(block, G)),
            ("aclrtUnmapMem", AclError::RT_MEMORY_FREE)
        );
    }
    // The next block's call retries the release, refused once more: the new block goes
    // past what the retired one maps.
    sim.inject_fault(Fault::next(AclFunc::UnmapMem, AclError::RT_FAILURE, 1));
    let b = vmm.alloc_block(0, MemKind::DEVICE, 4 * G).unwrap();
    assert!(
        b.addr >= a.addr + 2 * G as usize,
        "{:#x} {:#x}",
        a.addr,
        b.addr
    );
    assert_eq!((vmm.stats().retired, used(&sim)), (1, 6 * G));
    vmm.validate().unwrap();
    // Its free retries again, and the retired memory goes back with it.
    vmm.free_block(b).unwrap();
    assert_eq!(vmm.stats(), Default::default());
    assert_eq!((used(&sim), sim.stats().mappings), (0, 0));
    vmm.validate().unwrap();
}

/// A source dropped while it still holds a retired block (its release refused once more)
/// unmaps and frees that block's memory with the rest: nothing stays open or mapped.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_source_dropped_with_a_retired_block_gives_its_memory_back() {
    let _g = serial();
    let (objects, mapped) = (memory_objects(), mapped_objects());
    let (sim, vmm) = vmm(64 * MIB);
    let a = three_extent_block(&vmm);
    free_refused_four_times(&sim, &vmm, a);
    sim.inject_fault(Fault::next(AclFunc::UnmapMem, AclError::RT_FAILURE, 1));
    vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    assert_eq!(vmm.stats().retired, 1);
    drop(vmm);
    assert_eq!((used(&sim), sim.stats().mappings), (0, 0));
    assert_eq!((memory_objects(), mapped_objects()), (objects, mapped));
}

/// A retired block's memory is held by no one, so nothing publishes it: `publish_all`
/// exports only live blocks' memory (and is refused, exporting nothing, when the retired
/// block is all the source maps), and a range over the retired block is refused as
/// memory the source does not hand out. Both used to export it.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_retired_block_is_never_published() {
    use ascend_pool::share::Access;
    let _g = serial();
    let (sim, vmm) = vmm(64 * MIB);
    let a = three_extent_block(&vmm);
    free_refused_four_times(&sim, &vmm, a);
    let exports = || sim.stats().calls(AclFunc::MemExportToShareableHandle);
    assert!(matches!(
        vmm.publish_all(&Access::AnyProcess),
        Err(Error::OutOfBounds { len: 0, .. })
    ));
    assert!(matches!(
        vmm.publish_range(a.addr, G, &Access::AnyProcess),
        Err(Error::ForeignHandle)
    ));
    assert_eq!(exports(), 0);
    // A live block beside it (the retry of the release refused once more).
    sim.inject_fault(Fault::next(AclFunc::UnmapMem, AclError::RT_FAILURE, 1));
    let b = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    assert_eq!(vmm.stats().retired, 1);
    let all = vmm.publish_all(&Access::AnyProcess).unwrap();
    assert_eq!(
        (all.base, all.span, all.pieces.len(), exports()),
        (b.addr, G, 1, 1)
    );
    // A range from the live block into the retired one is refused whole.
    let (lo, hi) = (a.addr.min(b.addr), a.addr.max(b.addr) + G as usize);
    assert!(matches!(
        vmm.publish_range(lo, (hi - lo) as u64, &Access::AnyProcess),
        Err(Error::ForeignHandle)
    ));
    assert_eq!(exports(), 1);
    vmm.validate().unwrap();
    vmm.free_block(b).unwrap();
    assert_eq!(vmm.stats(), Default::default());
}

/// A pool's chunk whose free (a trim) is refused four times in a row is gone from the pool:
/// its source retired the block, which the pool carves no more; the pool's figures and both
/// `validate`s agree, and once the regions, the pool and the source are dropped nothing is
/// left. The pool used to keep the chunk and carve it again, past its mapped bytes.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_chunk_whose_free_is_refused_four_times_is_never_carved_again() {
    let _g = serial();
    let (objects, mapped) = (memory_objects(), mapped_objects());
    let (sim, vmm) = vmm(256 * MIB);
    let vmm = Arc::new(vmm);
    let pool = pool_growing_in_place(&vmm);
    // One chunk of three extents: its first block, grown in place twice.
    let regions: Vec<_> = (0..3)
        .map(|_| pool.alloc_device(3 * MIB).unwrap())
        .collect();
    assert_eq!(
        (pool.stats(MemKind::DEVICE).chunks, vmm.stats().extents),
        (1, 3)
    );
    let chunk = pool.snapshot().kinds[0].chunks[0].clone();
    let (lo, hi) = (chunk.addr, chunk.addr + chunk.size as usize);
    drop(regions);
    let before = pool.stats(MemKind::DEVICE);

    sim.inject_fault(Fault {
        func: AclFunc::UnmapMem,
        code: AclError::RT_FAILURE,
        times: FaultTimes::After { skip: 1, n: 2 },
    });
    sim.inject_fault(Fault::next(AclFunc::MapMem, AclError::RT_FAILURE, 2));
    let released = pool.trim();
    vmm.validate().unwrap();
    pool.validate().unwrap();
    assert_eq!(released, before.reserved_bytes, "the chunk went");
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (st.chunks, st.reserved_bytes, st.source_free_calls),
        (0, 0, before.source_free_calls + 1)
    );
    assert_eq!((vmm.stats().blocks, vmm.stats().retired), (0, 1));
    // What the retired block still maps: its first two extents.
    let retired = vmm.stats().mapped_bytes;
    assert!(retired > 0 && retired < chunk.size, "{retired}");

    // While the runtime refuses every unmap, every retry is refused: the block stays
    // retired, and no region lies in it.
    sim.inject_fault(Fault::always(AclFunc::UnmapMem, AclError::RT_FAILURE));
    let mut regions = Vec::new();
    for i in 0..8u8 {
        let mut r = pool.alloc_device(3 * MIB).unwrap();
        assert!(
            r.addr() + 3 * MIB as usize <= lo || r.addr() >= hi,
            "region {:#x} in the retired block {lo:#x}..{hi:#x}",
            r.addr()
        );
        let len = r.len();
        pool.copy_from_host(&mut r, 0, &[i; 64]).unwrap();
        pool.copy_from_host(&mut r, len - 64, &[i; 64]).unwrap();
        regions.push(r);
    }
    assert_eq!(vmm.stats().retired, 1);
    assert!(sim.stats().failures(AclFunc::UnmapMem) > 2, "retried");
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(st.reserved_bytes + retired, vmm.stats().mapped_bytes);
    pool.validate().unwrap();
    vmm.validate().unwrap();

    sim.clear_faults();
    drop(regions);
    drop(pool);
    assert_eq!(
        vmm.stats(),
        Default::default(),
        "the pool's last frees retried it"
    );
    drop(vmm);
    assert_eq!((used(&sim), sim.stats().mappings), (0, 0));
    assert_eq!((memory_objects(), mapped_objects()), (objects, mapped));
}

/// Publishing a range that starts where one physical allocation ends exports only the
/// allocations under the range.
#[test]
fn a_range_published_from_an_extent_boundary_exports_only_what_it_covers() {
    let _g = serial();
    let (sim, vmm) = vmm(64 * MIB);
    let a = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    let a = vmm.extend_block(a, G).unwrap().unwrap();
    assert_eq!(vmm.stats().extents, 2);
    let second = a.addr + G as usize;
    let desc = vmm
        .publish_range(second, G, &ascend_pool::share::Access::AnyProcess)
        .unwrap();
    assert_eq!(desc.base, second);
    assert_eq!((desc.pieces.len(), desc.offset, desc.len), (1, 0, G));
    assert_eq!(sim.stats().calls(AclFunc::MemExportToShareableHandle), 1);
    vmm.free_block(a).unwrap();
}

// A region taken over from one freed behind its stream's queued work (`alloc_device_on`) was
// published at once: another process's reads and writes, ordered after no stream of this
// one, could then meet that work still running.
#[test]
fn a_region_freed_behind_queued_work_is_published_once_that_work_ran() {
    use ascend_pool::share::Access;
    use std::sync::atomic::{AtomicBool, Ordering};
    let _g = serial();
    let sim = sim(64 * MIB);
    let vmm = Arc::new(VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default()).unwrap());
    let pool = Pool::new(vmm.clone(), PoolConfig::default()).unwrap();
    let s1 = pool.create_stream().unwrap();
    let stale = pool.alloc_device(MIB).unwrap();
    let hold = sim.hold_stream(s1.handle()).unwrap();
    let mut old = pool.alloc_device(MIB).unwrap();
    pool.copy_async(&mut old, 0, &stale, 0, MIB, &s1).unwrap();
    let at = old.addr();
    drop(old);
    let taken = pool.alloc_device_on(MIB, &s1).unwrap();
    assert_eq!(taken.addr(), at, "taken over at once on its stream");
    // A runtime that will not wait for that work: refused before anything is exported.
    sim.inject_fault(Fault::next(
        AclFunc::SynchronizeEvent,
        AclError::RT_FAILURE,
        1,
    ));
    assert_eq!(
        code(vmm.publish_region(&taken, &Access::AnyProcess)),
        ("aclrtSynchronizeEvent", AclError::RT_FAILURE)
    );
    assert_eq!(sim.stats().calls(AclFunc::MemExportToShareableHandle), 0);
    // Released from another thread: the publish waits for that work.
    let released = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(100));
            released.store(true, Ordering::SeqCst);
            hold.release();
        });
        vmm.publish_region(&taken, &Access::AnyProcess).unwrap();
        assert!(
            released.load(Ordering::SeqCst),
            "published while the old owner's copy was still queued"
        );
    });
    drop((taken, stale, s1));
    pool.validate().unwrap();
}

/// A source dropped with blocks still out unmaps them, frees their physical memory and
/// releases its reservation: the device is whole again and no memory object is left.
#[test]
fn a_source_dropped_with_blocks_out_gives_everything_back() {
    let _g = serial();
    let objects = memory_objects();
    let (sim, vmm) = vmm(64 * MIB);
    let a = vmm.alloc_block(0, MemKind::DEVICE, 3 * MIB).unwrap();
    vmm.extend_block(a, 5 * MIB).unwrap().unwrap();
    vmm.alloc_block(0, MemKind::DEVICE, 5 * MIB).unwrap();
    assert_eq!(used(&sim), 14 * MIB);
    assert!(memory_objects() > objects);
    drop(vmm);
    assert_eq!(used(&sim), 0);
    assert_eq!(memory_objects(), objects);
    let st = sim.stats();
    for f in [
        AclFunc::UnmapMem,
        AclFunc::FreePhysical,
        AclFunc::ReleaseMemAddress,
    ] {
        assert_eq!(st.failures(f), 0, "{f:?}");
    }
    assert_eq!(
        st.calls(AclFunc::UnmapMem),
        3,
        "one per physical allocation"
    );
    assert_eq!(st.calls(AclFunc::ReleaseMemAddress), 1);
}

/// A copy that starts in a mapping may run on into the mappings that follow it without a
/// gap, and no further: into an unmapped granule or past the reservation it is refused.
#[test]
fn copies_reach_across_mappings_only_while_every_byte_is_mapped() {
    let _g = serial();
    let sim = sim(64 * MIB);
    let g = 2 * MIB;
    // Granules 0, 1 and 3 of four mapped; 2 is a gap.
    let va = sim.reserve_mem_address(4 * g, 0, 0, 1).unwrap();
    let handles: Vec<PhysicalHandle> = (0..3).map(|_| sim.malloc_physical(0, g).unwrap()).collect();
    for (h, at) in handles.iter().zip([0, 1, 3]) {
        sim.map_mem(va + (at * g) as usize, g, 0, *h, 0).unwrap();
    }
    let at = |granule: u64, less: u64| va + (granule * g - less) as usize;
    let data: Vec<u8> = (0..=255).collect();
    write(&*sim, at(1, 128), &data);
    assert_eq!(read(&*sim, at(1, 128), 256), data, "across two mappings");
    let refused = |addr: usize, len: u64| {
        let bytes = vec![7u8; len as usize];
        // SAFETY: `bytes` holds `len` bytes; the simulator checks the device side.
        let r = unsafe {
            sim.memcpy(
                addr,
                len,
                bytes.as_ptr() as usize,
                len,
                MemcpyKind::HostToDevice,
            )
        };
        code(r) == ("aclrtMemcpy", AclError::INVALID_PARAM)
    };
    assert!(refused(at(2, 128), 256), "from a mapping into the gap");
    assert!(
        refused(at(1, 128), g + 256),
        "across a mapping, then into the gap"
    );
    assert!(refused(at(4, 128), 256), "past the reservation");
    assert!(refused(at(2, 0), 1), "in the gap");
    assert_eq!(
        read(&*sim, at(2, 128), 128),
        vec![0; 128],
        "nothing was written"
    );
    for at in [0, 1, 3] {
        sim.unmap_mem(va + (at * g) as usize).unwrap();
    }
    for h in handles {
        sim.free_physical(h).unwrap();
    }
    sim.release_mem_address(va).unwrap();
}

/// A copy that runs off a reservation's last mapping is refused even where an ordinary
/// block starts at that very address: only mappings continue a mapping.
#[test]
fn a_copy_does_not_run_from_a_mapping_into_the_block_after_it() {
    let _g = serial();
    let page = 4096;
    let sim = Arc::new(
        SimSource::new(
            SimConfig::default()
                .with_device_capacity(64 * MIB)
                .with_vmm_granularity(page),
        )
        .unwrap(),
    );
    // An ordinary block, then a one-page reservation asked to end where the block starts.
    // The kernel places new mappings below the last ones, so the page below a fresh block
    // is usually free; a few blocks are tried in case it is not.
    let mut blocks = Vec::new();
    let (block, va) = loop {
        let block = sim.alloc_block(0, MemKind::DEVICE, 64 << 10).unwrap();
        let want = block.addr - page as usize;
        let va = sim.reserve_mem_address(page, 0, want, 1).unwrap();
        if va == want {
            break (block, va);
        }
        sim.release_mem_address(va).unwrap();
        blocks.push(block);
        assert!(
            blocks.len() < 16,
            "no free page below any of 16 fresh blocks"
        );
    };
    let h = sim.malloc_physical(0, page).unwrap();
    sim.map_mem(va, page, 0, h, 0).unwrap();
    let data = vec![9u8; 256];
    write(&*sim, block.addr, &[1; 128]);
    // SAFETY: `data` holds 256 bytes; the simulator checks the device side.
    let r = unsafe {
        sim.memcpy(
            block.addr - 128,
            256,
            data.as_ptr() as usize,
            256,
            MemcpyKind::HostToDevice,
        )
    };
    assert_eq!(
        code(r),
        ("aclrtMemcpy", AclError::INVALID_PARAM),
        "from the mapping into the block"
    );
    assert_eq!(
        read(&*sim, block.addr, 128),
        vec![1; 128],
        "the block kept its bytes"
    );
    write(&*sim, block.addr - 128, &data[..128]);
    sim.unmap_mem(va).unwrap();
    sim.free_physical(h).unwrap();
    sim.release_mem_address(va).unwrap();
    for b in blocks.into_iter().chain([block]) {
        sim.free_block(b).unwrap();
    }
}

/// A simulator dropped while it still holds a reservation with memory mapped in it unmaps
/// and releases all of it: no memory object stays open or mapped.
#[test]
fn a_dropped_simulator_gives_back_what_it_still_holds() {
    let _g = serial();
    let (objects, mapped) = (memory_objects(), mapped_objects());
    let sim = sim(64 * MIB);
    let g = 2 * MIB;
    let va = sim.reserve_mem_address(2 * g, 0, 0, 1).unwrap();
    let h = sim.malloc_physical(0, 2 * g).unwrap();
    sim.map_mem(va, 2 * g, 0, h, 0).unwrap();
    write(&*sim, va + 5, b"held");
    assert_eq!(memory_objects(), objects + 1);
    assert!(mapped_objects() > mapped);
    drop(sim);
    assert_eq!(memory_objects(), objects);
    assert_eq!(mapped_objects(), mapped);
}

/// A pool configured for another device than its virtual-memory source's was made: its
/// streams, events and host memory were of its device, and every device request was refused
/// by the source (`aclrtMapMem`, `ACL_ERROR_RT_PARAM_INVALID`), a runtime error for a
/// mistake of configuration. Found by a review (session 77). Fixed by refusing the pool
/// with `Error::Config`, before it takes anything from the source.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_pool_for_another_device_than_its_virtual_memory_is_refused() {
    // Its memory objects would be counted by the tests that count them.
    let _g = serial();
    let sim = Arc::new(
        SimSource::new(
            SimConfig::default()
                .with_devices(2)
                .with_device_capacity(64 * MIB),
        )
        .unwrap(),
    );
    let on_1 = Arc::new(VmmSource::new(sim.clone(), 1, VmmConfig::default()).unwrap());
    match Pool::new(on_1.clone(), PoolConfig::default()) {
        Err(Error::Config(m)) => assert!(m.contains("device 1"), "{m}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert_eq!(sim.stats().live_streams + sim.stats().live_events, 0);
    // The source's own device is taken, and its memory is of that device.
    let pool = Pool::new(on_1, PoolConfig::default().with_device(1)).unwrap();
    let r = pool.alloc_device(4096).unwrap();
    assert_eq!(pool.create_stream().unwrap().device(), 1);
    drop(r);
    pool.validate().unwrap();
}

#[test]
fn a_reservation_for_a_device_the_runtime_lacks_is_refused() {
    // As `AclSource` refuses it (its aclrtSetDevice first) and `malloc_physical` does here:
    // the simulator reserved address space for device 99 or -1.
    let _g = serial();
    let sim = sim(64 * MIB);
    for device in [1, 99, -1] {
        assert_eq!(
            code(sim.reserve_address(device, G)),
            ("aclrtSetDevice", AclError::RT_PARAM_INVALID),
            "device {device}"
        );
        assert_eq!(
            code(sim.malloc_physical(device, G)).1,
            AclError::RT_PARAM_INVALID
        );
    }
    assert_eq!(sim.stats().reservations, 0);
    let va = sim.reserve_address(0, G).unwrap();
    sim.release_address(va).unwrap();
}

/// A shrink by less than a granule still gives back an extent that lies wholly past the
/// new end (mapped by a growth): what stays mapped is what the block keeps.
#[test]
fn a_shrink_by_less_than_a_granule_releases_an_extent_past_the_new_end() {
    let _g = serial();
    let vmm = VmmSource::new(sim(64 * MIB), 0, VmmConfig::default()).unwrap();
    let a = vmm.alloc_block(0, MemKind::DEVICE, 2 * G).unwrap();
    // A growth of one byte maps one more granule, an extent of its own.
    let a = vmm.extend_block(a, 1).unwrap().unwrap();
    assert_eq!(vmm.stats().mapped_bytes, 3 * G);
    // Shrunk by less than a granule, past the start of that extent.
    let a = vmm.shrink_block(a, G + 2).unwrap();
    assert_eq!(vmm.stats().mapped_bytes, 2 * G);
    assert_eq!(a.size, 2 * G, "the block keeps what stays mapped");
    vmm.validate().unwrap();
    vmm.free_block(a).unwrap();
    assert_eq!(vmm.stats().mapped_bytes, 0);
}

/// `aclrtMemImportFromShareableHandle` names a device like every call that takes one: a
/// device the runtime lacks is refused, and nothing is imported.
#[test]
fn an_import_onto_a_device_out_of_range_is_refused() {
    let _g = serial();
    let sim = sim(64 * MIB);
    let h = sim.malloc_physical(0, G).unwrap();
    // Any process may import it, this one too.
    let s = sim.export_shareable(h, 1).unwrap();
    let func = AclFunc::MemImportFromShareableHandle.name();
    for device in [1, 99, -1] {
        assert_eq!(
            code(sim.import_shareable(s, device)),
            (func, AclError::RT_PARAM_INVALID),
            "device {device}"
        );
    }
    assert_eq!(sim.stats().physical_handles, 1);
    let imported = sim.import_shareable(s, 0).unwrap();
    sim.free_physical(imported).unwrap();
    sim.free_physical(h).unwrap();
}

/// A granule below the runtime's minimum granularity is refused when the source is made,
/// not at its first allocation, which the runtime would refuse.
#[test]
fn a_granule_below_the_runtime_granularity_is_a_config_error() {
    let _g = serial();
    for granule in [MIB, 64 << 10] {
        let r = VmmSource::new(sim(64 * MIB), 0, VmmConfig::default().with_granule(granule));
        assert!(matches!(r, Err(Error::Config(_))), "{granule}: {r:?}");
    }
    VmmSource::new(sim(64 * MIB), 0, VmmConfig::default().with_granule(2 * G)).unwrap();
}

/// Size 0 is refused by every allocation call: the source answers it as
/// `aclrtMallocPhysical` would, without calling the runtime.
#[test]
fn a_device_block_of_0_bytes_is_refused_before_the_runtime() {
    let _g = serial();
    let sim = sim(64 * MIB);
    let vmm = VmmSource::new(sim.clone(), 0, VmmConfig::default()).unwrap();
    assert_eq!(
        code(vmm.alloc_block(0, MemKind::DEVICE, 0)),
        ("aclrtMallocPhysical", AclError::INVALID_PARAM)
    );
    let stats = sim.stats();
    assert_eq!(stats.calls.get(&AclFunc::MallocPhysical), None);
    assert_eq!(stats.calls.get(&AclFunc::MapMem), None);
}

/// `HUGE1G` memory maps only at a 1 GiB boundary, its granularity, though the range is
/// reserved in the default granularity's steps.
#[test]
fn huge1g_memory_maps_only_on_a_1_gib_boundary() {
    let _g = serial();
    let sim = sim(2 << 30);
    let huge1g = PhysicalMemProp {
        mem_attr: 10, // ACL_HBM_MEM_HUGE1G
        ..PhysicalMemProp::device(0)
    };
    let gib = 1u64 << 30;
    let va = sim.reserve_mem_address(2 * gib, 0, 0, 1).unwrap();
    let h = sim.malloc_physical_with(gib, Some(&huge1g), 0).unwrap();
    assert_eq!(
        code(sim.map_mem(va + G as usize, gib, 0, h, 0)),
        ("aclrtMapMem", AclError::INVALID_PARAM)
    );
    sim.map_mem(va, gib, 0, h, 0).unwrap();
    sim.unmap_mem(va).unwrap();
    sim.free_physical_handle(h).unwrap();
    sim.release_mem_address(va).unwrap();
}

/// A tail the runtime refuses to unmap on trim is still a call giving memory back, as a
/// refused block free is: counted once, with the chunk and its reservation kept whole (the
/// engine takes the tail back), and given back by the next trim.
#[test]
fn a_refused_tail_shrink_is_counted_as_a_call_and_kept() {
    let _g = serial();
    let (sim, vmm) = vmm(256 * MIB);
    let vmm = Arc::new(vmm);
    let pool = pool_growing_in_place(&vmm);
    let first = pool.alloc_device(3 * MIB).unwrap();
    let second = pool.alloc_device(3 * MIB).unwrap();
    drop(second);
    let before = pool.stats(MemKind::DEVICE);
    assert_eq!(before.chunks, 1, "{before:?}");
    sim.inject_fault(Fault::next(AclFunc::UnmapMem, AclError::RT_FAILURE, 1));
    assert_eq!(pool.trim(), 0, "the runtime kept the tail");
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (st.chunks, st.reserved_bytes, st.source_free_calls),
        (1, before.reserved_bytes, before.source_free_calls + 1),
        "{st:?}"
    );
    pool.validate().unwrap();
    // The fault spent, the tail goes back: a second call.
    let released = pool.trim();
    let st = pool.stats(MemKind::DEVICE);
    assert!(released > 0, "{st:?}");
    assert_eq!(
        (st.reserved_bytes, st.source_free_calls),
        (
            before.reserved_bytes - released,
            before.source_free_calls + 2
        ),
        "{st:?}"
    );
    drop(first);
    pool.validate().unwrap();
    vmm.validate().unwrap();
}
