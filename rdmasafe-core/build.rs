//! Build script, for the `sideway` feature only.
//!
//! sideway's FFI crate, rdma-mummy-sys, builds static shims named
//! `libibverbs.a` and `librdmacm.a` (wrappers that dlopen rdma-core's
//! libraries at run time) and puts their directory on the linker's search
//! path ahead of the system's. Every other `-libverbs` / `-lrdmacm` in the
//! link (rdma-sys's, so rdmasafe's) then finds the shims instead of
//! rdma-core's libraries, and the shims lack functions rdmasafe calls
//! (`rdma_get_src_port`: "undefined symbol" at link time, see
//! docs/interop.md). Linking rdma-core's libraries by their sonames as well
//! makes every symbol resolve; the shims forward to the same libraries.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_SIDEWAY").is_some() {
        println!("cargo:rustc-link-lib=dylib:+verbatim=librdmacm.so.1");
        println!("cargo:rustc-link-lib=dylib:+verbatim=libibverbs.so.1");
    }
}
