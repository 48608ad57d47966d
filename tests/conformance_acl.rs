//! The conformance suite through `AclSource` over the simulator drop-in `libascendcl.so`:
//! the same tests the simulator passes directly, through the C ABI and back.
//!
//! Each source loads a private copy of the library, so every test gets a simulator of its
//! own configured through the drop-in's environment variables.

#[path = "common/dropin.rs"]
mod common_dropin;
mod conformance;

conformance_suite!(|capacity| { Arc::new(common_dropin::private_acl_source(capacity)) });
