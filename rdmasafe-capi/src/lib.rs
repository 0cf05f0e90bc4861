//! The C ABI of rdmasafe (`librdmasafe.so`, `librdmasafe.a`,
//! `include/rdmasafe.h`).
//!
//! A thin layer over `rdmasafe-core`: argument checks, the panic boundary
//! (`guard`) that every export goes through, and the mapping from Rust
//! errors to the two C conventions (librdmacm's -1/errno for the drop-in CM
//! calls, a negative errno return for everything else).

#![deny(unsafe_op_in_unsafe_fn)]
// Exported types carry their C names (rdmasafe_cq_loop, ...).
#![allow(non_camel_case_types)]

mod cm;
mod cq;
#[doc(hidden)]
pub mod fuzzing;
mod log;

pub use cm::*;
pub use cq::*;
pub use log::*;

use std::os::raw::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs an export's body; a panic becomes `on_panic` instead of unwinding
/// into C (which would be undefined behaviour).
pub(crate) fn guard<T>(on_panic: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            rdmasafe_core::log::log(
                rdmasafe_core::log::Level::Error,
                format_args!("internal panic caught at the C boundary"),
            );
            on_panic
        }
    }
}

/// For the -1/errno functions: sets errno and returns -1.
pub(crate) fn fail_errno(errno: c_int) -> c_int {
    rdmasafe_core::sys::set_errno(errno);
    -1
}
