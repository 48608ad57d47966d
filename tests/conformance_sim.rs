//! The conformance suite on the simulator, used directly.

mod conformance;

use ascend_pool::source::sim::{SimConfig, SimSource};

conformance_suite!(|capacity| {
    let config = SimConfig::default()
        // A second device, for the rules on copies between two devices of one source.
        .with_devices(2)
        .with_device_capacity(capacity)
        .with_host_capacity(capacity)
        // Copies take real time (2 GB/s), so a reuse-before-the-stream-passes bug corrupts data.
        .with_copy_bandwidth(2_000_000_000);
    Arc::new(SimSource::new(config).unwrap())
});

/// What only the simulator shows of the suite's
/// `copies_between_two_devices_are_refused_sync_as_async`: regions of pools on two devices
/// are refused before the runtime is called (no copy reaches it, refused or not), and the
/// pools stay whole and serve copies within their device after.
#[test]
fn regions_of_two_devices_are_refused_before_the_runtime() {
    use ascend_pool::source::sim::AclFunc;
    let sim = Arc::new(SimSource::new(SimConfig::default().with_devices(2)).unwrap());
    let a = Pool::new(sim.clone(), PoolConfig::default()).unwrap();
    let b = Pool::new(sim.clone(), PoolConfig::default().with_device(1)).unwrap();
    let mut on0 = a.alloc_device(256).unwrap();
    let mut on1 = b.alloc_device(256).unwrap();
    let mut dvpp1 = b.alloc_dvpp(256).unwrap();
    let (s0, s1) = (a.create_stream().unwrap(), b.create_stream().unwrap());
    let copies = || {
        let stats = sim.stats();
        let calls = |f| stats.calls.get(&f).copied().unwrap_or(0);
        (calls(AclFunc::Memcpy), calls(AclFunc::MemcpyAsync))
    };
    let before = copies();
    for pool in [&a, &b] {
        for s in [&s0, &s1] {
            let r = pool.copy_async(&mut on0, 0, &on1, 0, 64, s);
            assert!(matches!(r, Err(Error::ForeignHandle)), "{r:?}");
            let r = pool.copy_async(&mut dvpp1, 0, &on0, 0, 64, s);
            assert!(matches!(r, Err(Error::ForeignHandle)), "{r:?}");
        }
        let r = pool.copy(&mut on1, 0, &on0, 0, 64);
        assert!(matches!(r, Err(Error::ForeignHandle)), "{r:?}");
        let r = pool.copy(&mut on0, 0, &dvpp1, 0, 64);
        assert!(matches!(r, Err(Error::ForeignHandle)), "{r:?}");
    }
    assert_eq!(copies(), before, "a refused copy reached the runtime");
    a.validate().unwrap();
    b.validate().unwrap();
    b.copy_from_host(&mut on1, 0, &[5; 256]).unwrap();
    b.copy_async(&mut dvpp1, 0, &on1, 0, 256, &s1).unwrap();
    s1.synchronize().unwrap();
    let mut out = [0u8; 256];
    b.copy_to_host(&dvpp1, 0, &mut out).unwrap();
    assert_eq!(out, [5; 256]);
    drop((on0, on1, dvpp1));
    // The frees behind `s1`'s copy complete once it has run.
    b.synchronize().unwrap();
    assert!(a.leak_report().is_empty(), "{:?}", a.leak_report());
    assert!(b.leak_report().is_empty(), "{:?}", b.leak_report());
    a.validate().unwrap();
    b.validate().unwrap();
}
