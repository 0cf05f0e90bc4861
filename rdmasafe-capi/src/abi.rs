//! ABI evolution: structs that carry their own size, and the version.
//!
//! Every struct the library reads or fills starts with `uint32_t size`,
//! which the caller sets to `sizeof` the struct *as its header declares
//! it*. Fields are only ever appended, so:
//!
//! * an output struct (stats, counters, async events) gets exactly
//!   `min(size, sizeof ours)` bytes written, and its `size` field is set to
//!   that number, so a caller built against an older, shorter header never
//!   has memory written past its struct, and a caller built against a newer,
//!   longer header learns which fields this library filled;
//! * an input struct (options) is read for `min(size, sizeof ours)` bytes,
//!   fields past the caller's size take their defaults, and bytes past ours
//!   must be zero (a newer caller asking for something this library does
//!   not know gets -E2BIG instead of being silently ignored).
//!
//! A `size` below 4 (e.g. a zero-initialised struct whose size was never
//! set) or above 4096 is -EINVAL.

use std::os::raw::{c_char, c_int};

/// Largest `size` accepted in a sized struct.
const MAX_STRUCT_SIZE: usize = 4096;
/// The `size` field itself.
const SIZE_FIELD: usize = std::mem::size_of::<u32>();

/// Major version of this library (`RDMASAFE_VERSION_MAJOR` in the header).
pub const RDMASAFE_VERSION_MAJOR: c_int = 0;
/// Minor version.
pub const RDMASAFE_VERSION_MINOR: c_int = 2;
/// Patch version.
pub const RDMASAFE_VERSION_PATCH: c_int = 0;

/// The version as a NUL-terminated string, from Cargo.toml (the single
/// source: CMake and pkg-config read the same file).
const VERSION_CSTR: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

/// The caller's `size` field, checked.
///
/// # Safety
/// `p` must be readable for 4 bytes.
unsafe fn caller_size(p: *const u8) -> Result<usize, c_int> {
    // SAFETY: the first field of every sized struct is a u32 (caller).
    let size = unsafe { p.cast::<u32>().read_unaligned() } as usize;
    if !(SIZE_FIELD..=MAX_STRUCT_SIZE).contains(&size) {
        log::error!(target: "rdmasafe", "struct size field is {size}: set .size = sizeof(the struct) before the call");
        return Err(-libc::EINVAL);
    }
    Ok(size)
}

/// Checks a sized struct's `size` field before work whose result would be
/// lost if the write failed afterwards (e.g. an event already acked).
///
/// # Safety
/// `p` must be readable for 4 bytes.
pub(crate) unsafe fn check_size<T>(p: *const T) -> Result<(), c_int> {
    // SAFETY: forwarded contract.
    unsafe { caller_size(p.cast()) }.map(|_| ())
}

/// Reads a sized input struct into a `T` (fields past the caller's size
/// keep `T::default()`).
///
/// # Safety
/// `p` must be readable for the `size` its first field states.
pub(crate) unsafe fn read_in<T: Copy + Default>(p: *const T) -> Result<T, c_int> {
    let bytes = p.cast::<u8>();
    // SAFETY: forwarded contract.
    let size = unsafe { caller_size(bytes)? };
    let ours = std::mem::size_of::<T>();
    if size > ours {
        // SAFETY: the caller's struct is `size` bytes long.
        let extra = unsafe { std::slice::from_raw_parts(bytes.add(ours), size - ours) };
        if extra.iter().any(|b| *b != 0) {
            return Err(-libc::E2BIG);
        }
    }
    let mut v = T::default();
    let n = size.min(ours);
    // SAFETY: n bytes are readable in the caller's struct and writable in v
    // (n <= sizeof T); T is plain data for which any bytes the caller gives
    // are as valid as in C (integers only).
    unsafe { std::ptr::copy_nonoverlapping(bytes, (&mut v as *mut T).cast::<u8>(), n) };
    Ok(v)
}

/// Writes `v` into a sized output struct: `min(size, sizeof T)` bytes, and
/// the size field set to that number.
///
/// # Safety
/// `p` must be writable for the `size` its first field states.
pub(crate) unsafe fn write_out<T: Copy>(p: *mut T, v: &T) -> Result<(), c_int> {
    let bytes = p.cast::<u8>();
    // SAFETY: forwarded contract.
    let size = unsafe { caller_size(bytes)? };
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: n bytes fit both structs; the size field is written last, as
    // the u32 it is.
    unsafe {
        std::ptr::copy_nonoverlapping(
            (v as *const T).cast::<u8>().add(SIZE_FIELD),
            bytes.add(SIZE_FIELD),
            n - SIZE_FIELD,
        );
        bytes.cast::<u32>().write_unaligned(n as u32);
    }
    Ok(())
}

/// The library's version: returns "MAJOR.MINOR.PATCH" (static, never NULL)
/// and stores the parts through the pointers that are not NULL. Compare
/// with RDMASAFE_VERSION_MAJOR, RDMASAFE_VERSION_MINOR and
/// RDMASAFE_VERSION_PATCH (RDMASAFE_VERSION_STRING: all three) from the
/// header the program was built with: the same major and a minor at least the
/// header's means every function and struct field the program knows is
/// there. Thread-safe, never fails.
///
/// # Safety
/// Each pointer NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rdmasafe_version(major: *mut c_int, minor: *mut c_int, patch: *mut c_int) -> *const c_char {
    crate::guard(
        || VERSION_CSTR.as_ptr().cast(),
        || {
            for (p, v) in
                [(major, RDMASAFE_VERSION_MAJOR), (minor, RDMASAFE_VERSION_MINOR), (patch, RDMASAFE_VERSION_PATCH)]
            {
                if !p.is_null() {
                    // SAFETY: non-NULL pointers are writable (caller).
                    unsafe { *p = v };
                }
            }
            VERSION_CSTR.as_ptr().cast()
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C)]
    #[derive(Clone, Copy, Default, Debug, PartialEq)]
    struct Ours {
        size: u32,
        a: u32,
        b: u64,
    }

    #[test]
    fn version_constants_match_cargo() {
        let v: Vec<c_int> = env!("CARGO_PKG_VERSION").split('.').map(|p| p.parse().unwrap()).collect();
        assert_eq!(v, [RDMASAFE_VERSION_MAJOR, RDMASAFE_VERSION_MINOR, RDMASAFE_VERSION_PATCH]);
        let (mut a, mut b, mut c) = (-1, -1, -1);
        // SAFETY: valid out pointers; the result is a static C string.
        let s = unsafe { std::ffi::CStr::from_ptr(rdmasafe_version(&mut a, &mut b, &mut c)) };
        assert_eq!(s.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
        assert_eq!([a, b, c], [RDMASAFE_VERSION_MAJOR, RDMASAFE_VERSION_MINOR, RDMASAFE_VERSION_PATCH]);
        // SAFETY: NULL pointers are allowed.
        assert!(
            !unsafe { rdmasafe_version(std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut()) }.is_null()
        );
    }

    #[test]
    fn output_writes_only_what_the_caller_size_covers() {
        let v = Ours { size: 0, a: 7, b: 9 };
        // An older caller: only `size` and `a`, then canary bytes.
        let mut buf = [0xAAu8; 32];
        buf[..4].copy_from_slice(&8u32.to_ne_bytes());
        // SAFETY: buf is 32 writable bytes, size says 8.
        unsafe { write_out(buf.as_mut_ptr().cast::<Ours>(), &v).unwrap() };
        assert_eq!(u32::from_ne_bytes(buf[..4].try_into().unwrap()), 8);
        assert_eq!(u32::from_ne_bytes(buf[4..8].try_into().unwrap()), 7);
        assert!(buf[8..].iter().all(|b| *b == 0xAA), "nothing past the caller's size");
        // A newer caller: 24 bytes; we fill 16 and say so.
        let mut buf = [0xAAu8; 32];
        buf[..4].copy_from_slice(&24u32.to_ne_bytes());
        // SAFETY: as above.
        unsafe { write_out(buf.as_mut_ptr().cast::<Ours>(), &v).unwrap() };
        assert_eq!(u32::from_ne_bytes(buf[..4].try_into().unwrap()), 16);
        assert_eq!(u64::from_ne_bytes(buf[8..16].try_into().unwrap()), 9);
        assert!(buf[16..].iter().all(|b| *b == 0xAA));
        // Unset size: EINVAL, nothing written.
        let mut z = Ours::default();
        // SAFETY: a whole Ours.
        assert_eq!(unsafe { write_out(&mut z, &v) }, Err(-libc::EINVAL));
        assert_eq!(z, Ours::default());
    }

    #[test]
    fn input_defaults_past_the_caller_and_refuses_unknown_set_fields() {
        let mut buf = [0u8; 32];
        buf[..4].copy_from_slice(&8u32.to_ne_bytes());
        buf[4..8].copy_from_slice(&5u32.to_ne_bytes());
        buf[8..16].copy_from_slice(&99u64.to_ne_bytes()); // past the caller's size: ignored
                                                          // SAFETY: 32 readable bytes.
        let v = unsafe { read_in(buf.as_ptr().cast::<Ours>()).unwrap() };
        assert_eq!((v.a, v.b), (5, 0));
        // Newer caller, extra bytes zero: fine.
        buf[..4].copy_from_slice(&32u32.to_ne_bytes());
        // SAFETY: as above.
        let v = unsafe { read_in(buf.as_ptr().cast::<Ours>()).unwrap() };
        assert_eq!((v.a, v.b), (5, 99));
        // Newer caller that set a field we do not know: E2BIG.
        buf[20] = 1;
        // SAFETY: as above.
        assert_eq!(unsafe { read_in(buf.as_ptr().cast::<Ours>()) }, Err(-libc::E2BIG));
        buf[..4].copy_from_slice(&0u32.to_ne_bytes());
        // SAFETY: as above.
        assert_eq!(unsafe { read_in(buf.as_ptr().cast::<Ours>()) }, Err(-libc::EINVAL));
        buf[..4].copy_from_slice(&5000u32.to_ne_bytes());
        // SAFETY: rejected before anything past 4 bytes is read.
        assert_eq!(unsafe { read_in(buf.as_ptr().cast::<Ours>()) }, Err(-libc::EINVAL));
    }
}
