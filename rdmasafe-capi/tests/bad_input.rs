//! Table-driven bad input for every exported C function: NULL pointers,
//! pointers rdmasafe never handed out, out-of-range counts, modes, timeouts
//! and levels. Each row states the documented error; none may crash or
//! abort. The table must name every export in abi/exports.txt, so a new
//! function cannot ship without its row. (After-destroy and double-free
//! cases need a device and run in the guest: tests/c/cq_loop_test.c and
//! tests/c/cm_capi_test.c.)

use std::os::raw::c_int;
use std::ptr::null_mut;

use rdmasafe::*;

fn errno() -> i32 {
    rdmasafe_core::sys::errno()
}

/// -1 with errno EINVAL (the librdmacm convention of the drop-in calls).
fn minus1_einval(r: c_int) -> bool {
    r == -1 && errno() == libc::EINVAL
}

/// Must never be called: every row that passes it fails before any work.
unsafe extern "C" fn never_done(_: *mut std::os::raw::c_void, _: *mut std::os::raw::c_void, _: c_int) {
    panic!("a rejected call must not call its done callback");
}

/// Bytes aligned like the C structs they stand for.
#[repr(C, align(8))]
struct AlignedBytes<const N: usize>([u8; N]);
impl<const N: usize> AlignedBytes<N> {
    fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }
}

#[test]
fn every_export_rejects_bad_input_with_its_documented_error() {
    let mut wild_mem = [0u64; 32]; // never handed out by rdmasafe
    let wild = wild_mem.as_mut_ptr().cast::<u8>();
    let mut ev: *mut rdma_sys::rdma_cm_event = null_mut();
    let mut evs: [*mut rdma_sys::rdma_cm_event; 4] = [null_mut(); 4];
    let mut counters =
        rdmasafe_cm_counters { size: std::mem::size_of::<rdmasafe_cm_counters>() as u32, ..Default::default() };
    let mut unsized_counters = rdmasafe_cm_counters::default(); // size 0: never set
    let mut stats =
        rdmasafe_cq_loop_stats { size: std::mem::size_of::<rdmasafe_cq_loop_stats>() as u32, ..Default::default() };
    let mut out_loop: *mut rdmasafe_cq_loop = null_mut();
    let opts =
        rdmasafe_cq_loop_options { size: std::mem::size_of::<rdmasafe_cq_loop_options>() as u32, ..Default::default() };
    let bad_mode = rdmasafe_cq_loop_options { mode: 7, ..Default::default() };
    let cq_opts = rdmasafe_cq_options { size: std::mem::size_of::<rdmasafe_cq_options>() as u32, ..Default::default() };
    let unsized_cq_opts = rdmasafe_cq_options::default();
    // A newer caller's struct: 8 more bytes, one of them set.
    let mut big_cq_opts = [0u8; std::mem::size_of::<rdmasafe_cq_options>() + 8];
    let big_len = big_cq_opts.len() as u32;
    big_cq_opts[..4].copy_from_slice(&big_len.to_ne_bytes());
    *big_cq_opts.last_mut().unwrap() = 1;
    let big_cq_opts = AlignedBytes(big_cq_opts);
    let mut timeout_out: c_int = 77;
    // SAFETY: zeroed plain C struct.
    let mut aev: rdmasafe_async_event = unsafe { std::mem::zeroed() };
    aev.size = std::mem::size_of::<rdmasafe_async_event>() as u32;
    // The size rule of the sized output structs (the header's "Struct
    // sizes"): 0 (never set) and above 4096 are EINVAL; rdmasafe_async_get
    // checks it before it reads the context's fd.
    let mut aev_unset = aev;
    aev_unset.size = 0;
    let mut aev_huge = aev;
    aev_huge.size = 4097;

    // SAFETY (all rows): every pointer is NULL, or one the function looks up
    // before use (events, loops), or scalars are checked before a non-NULL
    // channel would be touched -- as the header documents.
    let rows: Vec<(&str, &str, bool)> = unsafe {
        vec![
            ("rdmasafe_get_event", "NULL channel", minus1_einval(rdmasafe_get_event(null_mut(), &mut ev))),
            ("rdmasafe_get_event", "NULL out", minus1_einval(rdmasafe_get_event(wild.cast(), null_mut()))),
            (
                "rdmasafe_get_event_timeout",
                "NULL channel",
                minus1_einval(rdmasafe_get_event_timeout(null_mut(), &mut ev, 0)),
            ),
            (
                "rdmasafe_get_event_timeout",
                "timeout -2",
                minus1_einval(rdmasafe_get_event_timeout(wild.cast(), &mut ev, -2)),
            ),
            ("rdmasafe_get_events", "max 0", minus1_einval(rdmasafe_get_events(wild.cast(), evs.as_mut_ptr(), 0, 0))),
            ("rdmasafe_get_events", "max -1", minus1_einval(rdmasafe_get_events(wild.cast(), evs.as_mut_ptr(), -1, 0))),
            (
                "rdmasafe_get_events",
                "timeout INT_MIN",
                minus1_einval(rdmasafe_get_events(wild.cast(), evs.as_mut_ptr(), 4, c_int::MIN)),
            ),
            ("rdmasafe_get_events", "NULL array", minus1_einval(rdmasafe_get_events(wild.cast(), null_mut(), 4, 0))),
            ("rdmasafe_event_free", "NULL is a no-op", rdmasafe_event_free(null_mut()) == 0),
            ("rdmasafe_event_free", "never handed out", minus1_einval(rdmasafe_event_free(wild.cast()))),
            ("rdmasafe_event_str", "-1", !rdmasafe_event_str(-1).is_null()),
            ("rdmasafe_event_str", "INT_MAX", !rdmasafe_event_str(c_int::MAX).is_null()),
            ("rdmasafe_cm_get_counters", "NULL", rdmasafe_cm_get_counters(null_mut()) == -libc::EINVAL),
            ("rdmasafe_cm_get_counters", "valid", rdmasafe_cm_get_counters(&mut counters) == 0),
            (
                "rdmasafe_cm_get_counters",
                "size 0",
                rdmasafe_cm_get_counters(&mut unsized_counters) == -libc::EINVAL && unsized_counters.copied == 0,
            ),
            ("rdmasafe_cm_reserve", "-1", rdmasafe_cm_reserve(-1) == -libc::EINVAL),
            ("rdmasafe_cm_set_ack_deadline", "-1", rdmasafe_cm_set_ack_deadline(-1) == -libc::EINVAL),
            ("rdmasafe_cm_set_ack_deadline", "INT_MIN", rdmasafe_cm_set_ack_deadline(c_int::MIN) == -libc::EINVAL),
            ("rdmasafe_cm_set_limit", "0 (unlimited)", rdmasafe_cm_set_limit(0) == 0),
            (
                "rdmasafe_event_get_contexts",
                "never handed out",
                rdmasafe_event_get_contexts(wild.cast(), null_mut(), null_mut()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_event_get_contexts",
                "NULL",
                rdmasafe_event_get_contexts(std::ptr::null(), null_mut(), null_mut()) == -libc::EINVAL,
            ),
            ("rdmasafe_cm_reserve", "INT_MAX capped", rdmasafe_cm_reserve(c_int::MAX) == 4096),
            (
                "rdmasafe_cq_loop_create",
                "NULL channel",
                rdmasafe_cq_loop_create(null_mut(), &opts, &mut out_loop) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_create",
                "NULL out",
                rdmasafe_cq_loop_create(wild.cast(), &opts, null_mut()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_create",
                "mode 7",
                rdmasafe_cq_loop_create(wild.cast(), &bad_mode, &mut out_loop) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_add_cq",
                "unknown loop",
                rdmasafe_cq_loop_add_cq(wild.cast(), wild.cast(), None, null_mut()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_add_cq_ex",
                "unknown loop",
                rdmasafe_cq_loop_add_cq_ex(wild.cast(), wild.cast(), &cq_opts, None, null_mut()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_add_cq_ex",
                "options size 0",
                rdmasafe_cq_loop_add_cq_ex(wild.cast(), wild.cast(), &unsized_cq_opts, None, null_mut())
                    == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_add_cq_ex",
                "unknown option set (E2BIG)",
                rdmasafe_cq_loop_add_cq_ex(wild.cast(), wild.cast(), big_cq_opts.as_ptr().cast(), None, null_mut())
                    == -libc::E2BIG,
            ),
            (
                "rdmasafe_cq_loop_remove_cq_async",
                "NULL done",
                rdmasafe_cq_loop_remove_cq_async(wild.cast(), wild.cast(), None, null_mut()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_remove_cq_async",
                "unknown loop",
                rdmasafe_cq_loop_remove_cq_async(wild.cast(), wild.cast(), Some(never_done), null_mut())
                    == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_destroy_cq",
                "NULL CQ",
                rdmasafe_cq_loop_destroy_cq(wild.cast(), null_mut()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_destroy_cq",
                "unknown loop",
                rdmasafe_cq_loop_destroy_cq(wild.cast(), wild.cast()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_next_timeout_ms",
                "NULL out",
                rdmasafe_cq_loop_next_timeout_ms(wild.cast(), null_mut()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_next_timeout_ms",
                "unknown loop",
                rdmasafe_cq_loop_next_timeout_ms(wild.cast(), &mut timeout_out) == -libc::EINVAL && timeout_out == 77,
            ),
            (
                "rdmasafe_cq_loop_drain_qp_async",
                "NULL done",
                rdmasafe_cq_loop_drain_qp_async(wild.cast(), wild.cast(), 0, 10, None, null_mut()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_drain_qp_async",
                "timeout 0",
                rdmasafe_cq_loop_drain_qp_async(wild.cast(), wild.cast(), 0, 0, Some(never_done), null_mut())
                    == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_drain_qp_async",
                "unknown loop",
                rdmasafe_cq_loop_drain_qp_async(wild.cast(), wild.cast(), 0, 10, Some(never_done), null_mut())
                    == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_remove_cq",
                "unknown loop",
                rdmasafe_cq_loop_remove_cq(wild.cast(), wild.cast()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_remove_cq",
                "NULL CQ",
                rdmasafe_cq_loop_remove_cq(wild.cast(), null_mut()) == -libc::EINVAL,
            ),
            ("rdmasafe_cq_loop_run", "unknown loop", rdmasafe_cq_loop_run(wild.cast()) == -libc::EINVAL),
            ("rdmasafe_cq_loop_run", "NULL", rdmasafe_cq_loop_run(null_mut()) == -libc::EINVAL),
            ("rdmasafe_cq_loop_run_once", "timeout -2", rdmasafe_cq_loop_run_once(wild.cast(), -2) == -libc::EINVAL),
            ("rdmasafe_cq_loop_run_once", "unknown loop", rdmasafe_cq_loop_run_once(wild.cast(), 0) == -libc::EINVAL),
            ("rdmasafe_cq_loop_fd", "unknown loop", rdmasafe_cq_loop_fd(wild.cast()) == -libc::EINVAL),
            ("rdmasafe_cq_loop_stop", "unknown loop", rdmasafe_cq_loop_stop(wild.cast()) == -libc::EINVAL),
            (
                "rdmasafe_cq_loop_set_outstanding",
                "unknown loop",
                rdmasafe_cq_loop_set_outstanding(wild.cast(), 1) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_get_stats",
                "NULL out",
                rdmasafe_cq_loop_get_stats(wild.cast(), null_mut()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_get_stats",
                "unknown loop",
                rdmasafe_cq_loop_get_stats(wild.cast(), &mut stats) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_drain_qp",
                "NULL QP",
                rdmasafe_cq_loop_drain_qp(wild.cast(), null_mut(), 0, 10) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_drain_qp",
                "timeout 0",
                rdmasafe_cq_loop_drain_qp(wild.cast(), wild.cast(), 0, 0) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_add_keepalive",
                "NULL QP",
                rdmasafe_cq_loop_add_keepalive(wild.cast(), null_mut(), 1, 1, 0, None, null_mut()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_add_keepalive",
                "period 0",
                rdmasafe_cq_loop_add_keepalive(wild.cast(), wild.cast(), 0, 1, 0, None, null_mut()) == -libc::EINVAL,
            ),
            (
                "rdmasafe_cq_loop_remove_keepalive",
                "NULL QP",
                rdmasafe_cq_loop_remove_keepalive(wild.cast(), null_mut()) == -libc::EINVAL,
            ),
            ("rdmasafe_cq_loop_destroy", "unknown loop", rdmasafe_cq_loop_destroy(wild.cast()) == -libc::EINVAL),
            ("rdmasafe_cq_loop_destroy", "NULL", rdmasafe_cq_loop_destroy(null_mut()) == -libc::EINVAL),
            ("rdmasafe_async_get", "NULL context", rdmasafe_async_get(null_mut(), &mut aev, 0) == -libc::EINVAL),
            ("rdmasafe_async_get", "NULL out", rdmasafe_async_get(wild.cast(), null_mut(), 0) == -libc::EINVAL),
            ("rdmasafe_async_get", "timeout -2", rdmasafe_async_get(wild.cast(), &mut aev, -2) == -libc::EINVAL),
            ("rdmasafe_async_get", "size 0", rdmasafe_async_get(wild.cast(), &mut aev_unset, 0) == -libc::EINVAL),
            ("rdmasafe_async_get", "size 4097", rdmasafe_async_get(wild.cast(), &mut aev_huge, 0) == -libc::EINVAL),
            ("rdmasafe_async_event_str", "u32::MAX", !rdmasafe_async_event_str(u32::MAX).is_null()),
            ("rdmasafe_set_log_level", "6", rdmasafe_set_log_level(6) == -libc::EINVAL),
            ("rdmasafe_version", "NULL parts", !rdmasafe_version(null_mut(), null_mut(), null_mut()).is_null()),
            ("rdmasafe_set_log_level", "-1", rdmasafe_set_log_level(-1) == -libc::EINVAL),
            ("rdmasafe_set_log_callback", "NULL (back to stderr)", rdmasafe_set_log_callback(None, null_mut()) == 0),
        ]
    };
    assert!(out_loop.is_null(), "failed creates store nothing");
    let failed: Vec<_> = rows.iter().filter(|r| !r.2).map(|r| format!("{} ({})", r.0, r.1)).collect();
    assert!(failed.is_empty(), "wrong result for: {failed:?}");

    let exports = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/abi/exports.txt")).unwrap();
    let missing: Vec<&str> = exports
        .lines()
        .map(|l| l.split('@').next().unwrap())
        .filter(|name| !rows.iter().any(|r| r.0 == *name))
        .collect();
    assert!(missing.is_empty(), "exports without a bad-input row: {missing:?}");
    println!("{} bad-input rows over every export", rows.len());
}
