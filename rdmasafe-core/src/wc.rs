//! Work completions: [`Wc`], a read-only view of libibverbs' `struct
//! ibv_wc`, with its status and opcode as small value types.
//!
//! Decision (API hygiene): handlers get `&[Wc]`, not `&[ibv_wc]`. `Wc` is
//! `#[repr(transparent)]` over the C struct, so a batch polled by
//! `ibv_poll_cq` is handed over without a copy, and the C library passes
//! the same memory to C callbacks as `const struct ibv_wc *`. The raw
//! struct stays reachable ([`Wc::as_raw`]) for code that needs a field we
//! do not wrap, without making rdma-sys part of the stable signatures.

use std::fmt;

use crate::sys::{self, ibv_wc};

/// The status of a work completion (`enum ibv_wc_status`).
/// `Default` is 0, success.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WcStatus(pub u32);

impl WcStatus {
    /// The request completed.
    pub const SUCCESS: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_SUCCESS);
    /// Local length error (a receive buffer too small, ...).
    pub const LOC_LEN_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_LOC_LEN_ERR);
    /// Local QP operation error.
    pub const LOC_QP_OP_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_LOC_QP_OP_ERR);
    /// Local protection error (a bad lkey or address).
    pub const LOC_PROT_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_LOC_PROT_ERR);
    /// Flushed: the QP went to the error state with the request queued
    /// (every request after a failure, or a drain).
    pub const WR_FLUSH_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR);
    /// Local access error.
    pub const LOC_ACCESS_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_LOC_ACCESS_ERR);
    /// Remote invalid request.
    pub const REM_INV_REQ_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_REM_INV_REQ_ERR);
    /// Remote access error (a bad rkey or range on RDMA READ / WRITE).
    pub const REM_ACCESS_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_REM_ACCESS_ERR);
    /// Remote operation error.
    pub const REM_OP_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_REM_OP_ERR);
    /// Transport retries exhausted: the peer did not answer.
    pub const RETRY_EXC_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
    /// Receiver-not-ready retries exhausted: no receive was posted.
    pub const RNR_RETRY_EXC_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR);
    /// Fatal error.
    pub const FATAL_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_FATAL_ERR);
    /// General error.
    pub const GENERAL_ERR: WcStatus = WcStatus(sys::ibv_wc_status::IBV_WC_GENERAL_ERR);

    /// True for [`WcStatus::SUCCESS`].
    pub fn is_success(self) -> bool {
        self == WcStatus::SUCCESS
    }

    /// libibverbs' name for it (`ibv_wc_status_str`), e.g. "transport retry
    /// counter exceeded".
    pub fn as_str(self) -> &'static str {
        // SAFETY: ibv_wc_status_str returns a pointer to a static string
        // (for every value, "unknown" for one it does not know).
        let p = unsafe { sys::ibv_wc_status_str(self.0) };
        if p.is_null() {
            return "unknown";
        }
        // SAFETY: NUL-terminated static string, see above.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap_or("unknown")
    }
}

impl fmt::Debug for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WcStatus({}: {})", self.0, self.as_str())
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a work completion is for (`enum ibv_wc_opcode`). Only meaningful
/// when the status is success (flushed completions may carry any value).
/// `Default` is 0, SEND.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct WcOpcode(pub u32);

impl WcOpcode {
    /// A SEND (any variant) completed.
    pub const SEND: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_SEND);
    /// An RDMA WRITE completed.
    pub const RDMA_WRITE: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_RDMA_WRITE);
    /// An RDMA READ completed.
    pub const RDMA_READ: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_RDMA_READ);
    /// An atomic compare-and-swap completed.
    pub const COMP_SWAP: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_COMP_SWAP);
    /// An atomic fetch-and-add completed.
    pub const FETCH_ADD: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_FETCH_ADD);
    /// A receive completed (a SEND arrived).
    pub const RECV: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_RECV);
    /// An RDMA WRITE with immediate arrived (consumed a receive).
    pub const RECV_RDMA_WITH_IMM: WcOpcode = WcOpcode(sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM);

    /// True for completions of the receive queue.
    pub fn is_recv(self) -> bool {
        self.0 & sys::ibv_wc_opcode::IBV_WC_RECV != 0
    }
}

/// One work completion, as `ibv_poll_cq` wrote it.
#[repr(transparent)]
pub struct Wc(ibv_wc);

impl Wc {
    /// An all-zero completion (to fill an array before polling).
    pub fn zeroed() -> Wc {
        // SAFETY: ibv_wc is plain data (integers and a union of integers);
        // all-zero is a valid value.
        Wc(unsafe { std::mem::zeroed() })
    }

    /// The `wr_id` of the request (or of the receive) it completes.
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    /// The status.
    pub fn status(&self) -> WcStatus {
        WcStatus(self.0.status)
    }

    /// True when the status is success.
    pub fn is_success(&self) -> bool {
        self.status().is_success()
    }

    /// The opcode (valid for successful completions only).
    pub fn opcode(&self) -> WcOpcode {
        WcOpcode(self.0.opcode)
    }

    /// Bytes received (receive completions, RDMA READ).
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }

    /// The immediate data (host byte order), when the completion carries
    /// one (a SEND or RDMA WRITE with immediate arrived).
    pub fn imm_data(&self) -> Option<u32> {
        if self.0.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0 {
            // SAFETY: with IBV_WC_WITH_IMM set the union holds imm_data; both
            // members are u32, so reading either is defined anyway.
            Some(u32::from_be(unsafe { self.0.imm_data_invalidated_rkey_union.imm_data }))
        } else {
            None
        }
    }

    /// The local QP number the completion belongs to.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    /// The remote QP number (UD receives).
    pub fn src_qp(&self) -> u32 {
        self.0.src_qp
    }

    /// The vendor's error code (error completions only).
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }

    /// The raw C struct, for fields not wrapped here.
    pub fn as_raw(&self) -> &ibv_wc {
        &self.0
    }

    /// Views polled C completions as `Wc`s, without a copy.
    pub fn from_raw_slice(wcs: &[ibv_wc]) -> &[Wc] {
        // SAFETY: Wc is repr(transparent) over ibv_wc: same size, alignment
        // and validity, so the slice can be reinterpreted.
        unsafe { std::slice::from_raw_parts(wcs.as_ptr().cast::<Wc>(), wcs.len()) }
    }

    /// The C struct array behind `wcs` (what `ibv_poll_cq` fills).
    pub fn as_raw_slice_mut(wcs: &mut [Wc]) -> &mut [ibv_wc] {
        // SAFETY: as in from_raw_slice.
        unsafe { std::slice::from_raw_parts_mut(wcs.as_mut_ptr().cast::<ibv_wc>(), wcs.len()) }
    }

    /// The C struct array behind `wcs` (to hand to a C callback).
    pub fn as_raw_slice(wcs: &[Wc]) -> &[ibv_wc] {
        // SAFETY: as in from_raw_slice.
        unsafe { std::slice::from_raw_parts(wcs.as_ptr().cast::<ibv_wc>(), wcs.len()) }
    }
}

impl Clone for Wc {
    fn clone(&self) -> Wc {
        // SAFETY: plain data (see zeroed); a bitwise copy is a valid value.
        Wc(unsafe { std::ptr::read(&self.0) })
    }
}

impl Default for Wc {
    fn default() -> Wc {
        Wc::zeroed()
    }
}

impl fmt::Debug for Wc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wc")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("qp_num", &self.qp_num())
            .field("imm_data", &self.imm_data())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wc_reads_its_fields_and_views_raw_arrays_in_place() {
        let mut raw: [ibv_wc; 2] = [Wc::zeroed().0, Wc::zeroed().0];
        raw[1].wr_id = 7;
        raw[1].status = sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
        raw[1].wc_flags = sys::ibv_wc_flags::IBV_WC_WITH_IMM.0;
        raw[1].imm_data_invalidated_rkey_union.imm_data = 0x1234_5678u32.to_be();
        let v = Wc::from_raw_slice(&raw);
        assert_eq!(v.as_ptr() as usize, raw.as_ptr() as usize, "no copy");
        assert_eq!(v[1].wr_id(), 7);
        assert_eq!(v[1].status(), WcStatus::WR_FLUSH_ERR);
        assert!(!v[1].is_success() && v[0].is_success());
        assert_eq!(v[1].imm_data(), Some(0x1234_5678));
        assert_eq!(v[0].imm_data(), None);
        assert_eq!(v[1].clone().wr_id(), 7);
        assert!(WcStatus::RETRY_EXC_ERR.to_string().contains("retry"), "{}", WcStatus::RETRY_EXC_ERR);
        assert!(WcOpcode::RECV.is_recv() && WcOpcode::RECV_RDMA_WITH_IMM.is_recv() && !WcOpcode::SEND.is_recv());
        assert_eq!(std::mem::size_of::<Wc>(), std::mem::size_of::<ibv_wc>());
    }
}
