//! Shared by the cargo-fuzz targets (tests/fuzz, nightly, run by hand) and
//! the property tests and corpus replay that run on stable in the test
//! command: both feed arbitrary bytes to the functions below, which decode
//! them into inputs and check invariants, panicking on a violation.
//!
//! Never called by the library itself; not part of the C ABI.

use std::ffi::CStr;
use std::os::raw::{c_int, c_void};

use rdmasafe_core::cm::{copy_synthetic, EventType, SyntheticEvent};
use rdmasafe_core::sys::rdma_cm_id;

use crate::*;

/// Reads fixed-size values from arbitrary bytes; missing bytes read as 0.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.0.len());
        out[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        out
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn i32(&mut self) -> i32 {
        i32::from_le_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

/// Copies a synthetic event built from `data`, laid out as librdmacm hands
/// events out (random type, status, ids present or not, contexts, private
/// data in librdmacm's inline buffer, or an arbitrary first word of `param`:
/// a multicast context, USER's cookie, anything) and checks the copy:
/// fields equal; private data byte-identical, owned (the C view points into
/// the copy) and zero past its length; any other first word passed through
/// untouched and never read; unknown types passed through; then hands it to
/// C and frees it once (0) and twice (EINVAL).
pub fn event_copy_case(data: &[u8]) {
    let mut b = Bytes(data);
    let flags = b.u8();
    // Mostly known types, sometimes anything.
    let raw_type = b.u32();
    let event = if flags & 0x80 != 0 { raw_type } else { raw_type % 20 };
    let status = b.i32();
    let (ctx, listen_ctx) = (b.u64() as usize, b.u64() as usize);
    let qp_type = b.u32() % 8;
    let len = b.u8();
    let word = b.u64() as usize;
    let mut src = [0u8; 256];
    for v in src.iter_mut() {
        *v = b.u8();
    }

    // SAFETY: plain C data; zero is valid.
    let mut id: rdma_cm_id = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut listen: rdma_cm_id = unsafe { std::mem::zeroed() };
    id.context = ctx as *mut c_void;
    id.qp_type = qp_type;
    listen.context = listen_ctx as *mut c_void;
    let mut ev = SyntheticEvent::zeroed();
    ev.event.event = event;
    ev.event.status = status;
    if flags & 1 != 0 {
        ev.event.id = &mut id;
    }
    if flags & 2 != 0 {
        ev.event.listen_id = &mut listen;
    }
    let multicast = matches!(EventType(event), EventType::MULTICAST_JOIN | EventType::MULTICAST_ERROR);
    // librdmacm's private data only for non-multicast types, as librdmacm.
    let with_data = flags & 4 != 0 && !multicast;
    let inline_addr = ev.private_data.as_ptr() as usize;
    // Anything else in the first word: a value, never read (never the
    // inline buffer's own address).
    let word = if word == inline_addr { word ^ 1 } else { word };
    if with_data {
        ev.set_private_data(&src[..len as usize]);
    } else {
        ev.event.param.conn.private_data = word as *const c_void;
        ev.event.param.conn.private_data_len = len;
    }

    // SAFETY: ids are NULL or live locals; private data (when present) is
    // in the inline buffer, readable for len bytes.
    let copy = unsafe { copy_synthetic(&ev.event) };
    let want = src;
    ev.private_data.fill(!src[0]); // the source changes after the copy

    assert_eq!(copy.event_type().0, event);
    assert_eq!(copy.status(), status);
    assert_eq!(copy.context(), if flags & 1 != 0 { ctx } else { 0 });
    assert_eq!(copy.listen_context(), if flags & 2 != 0 { listen_ctx } else { 0 });
    let c_view = copy.as_raw();
    // SAFETY: reading pointer values out of a union of plain data.
    let (c_ptr, c_len) = unsafe { (c_view.param.conn.private_data as usize, c_view.param.conn.private_data_len) };
    assert_eq!(c_len, len, "private_data_len passed through");
    if with_data {
        assert_eq!(copy.private_data(), &want[..len as usize], "private data byte-identical");
        assert_eq!(c_ptr, copy.private_data().as_ptr() as usize, "C view points into the copy");
        // SAFETY: the copy's buffer is 256 bytes long.
        let all = unsafe { std::slice::from_raw_parts(c_ptr as *const u8, 256) };
        assert!(all[len as usize..].iter().all(|b| *b == 0), "bytes past the private data read 0");
    } else {
        assert!(copy.private_data().is_empty());
        assert_eq!(c_ptr, word, "a first word that is not librdmacm's buffer passes through");
        assert_eq!(copy.param_word(), word as u64);
        if multicast {
            assert_eq!(copy.multicast_context(), Some(word as *mut c_void));
        }
    }
    // Name of any type: a static C string, never NULL.
    let name = crate::rdmasafe_event_str(event as c_int);
    // SAFETY: rdmasafe_event_str returns a static NUL-terminated string.
    assert!(unsafe { CStr::from_ptr(name) }.to_bytes().starts_with(b"RDMA_CM_EVENT_"));

    let p = crate::cm::hand_out(copy);
    // SAFETY: p was handed out just above; freeing twice is the point (the
    // quarantine keeps the storage from being handed out again in between).
    unsafe {
        assert_eq!(rdmasafe_event_free(p), 0);
        assert_eq!(rdmasafe_event_free(p), -1);
    }
    assert_eq!(rdmasafe_core::sys::errno(), libc::EINVAL);
}

/// Calls one exported function chosen by `data` with arguments from `data`
/// (NULL pointers, pointers rdmasafe never handed out, out-of-range counts,
/// modes, timeouts and levels) and checks it returns the documented error.
/// Pointers that the contract says must be valid when non-NULL (channels,
/// contexts) are only ever NULL here; handle-like pointers (events, loops)
/// are arbitrary, since rdmasafe looks them up before touching them.
unsafe extern "C" fn fuzz_never_done(_: *mut c_void, _: *mut c_void, _: c_int) {
    panic!("a rejected call must not call its done callback");
}

pub fn c_args_case(data: &[u8]) {
    let mut b = Bytes(data);
    let which = b.u8() % 17;
    let (i, j) = (b.i32(), b.i32());
    let wild = (b.u64() as usize | 1) as *mut u8; // never NULL, never handed out
    let einval_errno = |r: c_int| {
        assert_eq!(r, -1);
        assert_eq!(rdmasafe_core::sys::errno(), libc::EINVAL);
    };
    let mut ev: *mut rdma_sys::rdma_cm_event = std::ptr::null_mut();
    // SAFETY: every call below passes NULL or a pointer the function looks
    // up before use, as documented in the header.
    unsafe {
        match which {
            0 => einval_errno(rdmasafe_event_free(wild.cast())),
            1 => einval_errno(rdmasafe_get_event(std::ptr::null_mut(), &mut ev)),
            2 => einval_errno(rdmasafe_get_event_timeout(std::ptr::null_mut(), &mut ev, i)),
            3 => {
                // Scalars are checked before the channel is touched, so a
                // bad max / timeout is EINVAL even with a wild channel.
                if j < 1 || i < -1 {
                    einval_errno(rdmasafe_get_events(wild.cast(), &mut ev, j, i));
                } else {
                    einval_errno(rdmasafe_get_events(std::ptr::null_mut(), &mut ev, j, i));
                }
            }
            4 => assert_eq!(rdmasafe_cq_loop_run(wild.cast()), -libc::EINVAL),
            5 => assert_eq!(rdmasafe_cq_loop_run_once(wild.cast(), i), -libc::EINVAL),
            6 => assert_eq!(rdmasafe_cq_loop_stop(wild.cast()), -libc::EINVAL),
            7 => assert_eq!(rdmasafe_cq_loop_destroy(wild.cast()), -libc::EINVAL),
            8 => {
                let opts = rdmasafe_cq_loop_options {
                    size: std::mem::size_of::<rdmasafe_cq_loop_options>() as u32,
                    mode: i,
                    poll_batch: j,
                    ack_batch: b.i32(),
                    adaptive_spin_us: b.i32(),
                    watchdog_ms: b.i32(),
                    solicited_only: b.i32(),
                    timing_stats: b.i32(),
                    learn_latency_weight: b.i32(),
                };
                let mut out = std::ptr::null_mut();
                assert_eq!(rdmasafe_cq_loop_create(std::ptr::null_mut(), &opts, &mut out), -libc::EINVAL);
                assert!(out.is_null());
            }
            9 => {
                let r = rdmasafe_cm_reserve(i);
                if i < 0 {
                    assert_eq!(r, -libc::EINVAL);
                } else {
                    assert!((0..=4096).contains(&r), "reserve({i}) -> {r}");
                }
            }
            10 => {
                let s = CStr::from_ptr(rdmasafe_async_event_str(i as u32));
                assert!(s.to_bytes().starts_with(b"IBV_EVENT_"));
            }
            11 => {
                let r = rdmasafe_set_log_level(i);
                assert_eq!(r, if (0..=5).contains(&i) { 0 } else { -libc::EINVAL });
                rdmasafe_set_log_level(0);
            }
            12 => {
                let mut a = std::mem::zeroed();
                assert_eq!(rdmasafe_async_get(std::ptr::null_mut(), &mut a, i), -libc::EINVAL);
            }
            13 => {
                let mut t: c_int = 77;
                assert_eq!(rdmasafe_cq_loop_next_timeout_ms(wild.cast(), &mut t), -libc::EINVAL);
                assert_eq!(t, 77, "a failed call writes nothing");
            }
            14 => {
                // Whatever the CQ and callback, an unknown loop is rejected
                // before either is looked at, and nothing is called back.
                assert_eq!(
                    rdmasafe_cq_loop_remove_cq_async(wild.cast(), wild.cast(), None, wild.cast()),
                    -libc::EINVAL
                );
                assert_eq!(
                    rdmasafe_cq_loop_remove_cq_async(wild.cast(), wild.cast(), Some(fuzz_never_done), wild.cast()),
                    -libc::EINVAL
                );
                assert_eq!(rdmasafe_cq_loop_destroy_cq(wild.cast(), wild.cast()), -libc::EINVAL);
                assert_eq!(rdmasafe_cq_loop_remove_cq(wild.cast(), wild.cast()), -libc::EINVAL);
            }
            15 => {
                assert_eq!(
                    rdmasafe_cq_loop_drain_qp_async(wild.cast(), wild.cast(), i, j, Some(fuzz_never_done), wild.cast()),
                    -libc::EINVAL
                );
                assert_eq!(rdmasafe_cq_loop_drain_qp(wild.cast(), wild.cast(), i, j), -libc::EINVAL);
            }
            _ => {
                let mut s = rdmasafe_cq_loop_stats {
                    size: std::mem::size_of::<rdmasafe_cq_loop_stats>() as u32,
                    ..Default::default()
                };
                assert_eq!(rdmasafe_cq_loop_get_stats(wild.cast(), &mut s), -libc::EINVAL);
                assert_eq!(
                    rdmasafe_cq_loop_add_cq(wild.cast(), std::ptr::null_mut(), None, std::ptr::null_mut()),
                    -libc::EINVAL
                );
            }
        }
    }
}
