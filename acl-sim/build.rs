//! Links the drop-in so that it is never unloaded: its simulator lives in a static with
//! stream threads of its own, and every thread that calls it registers thread-local
//! destructors in it. A `dlclose` that unmapped it would leave them running unmapped code.

fn main() {
    println!("cargo::rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
