//! Interop with the [sideway](https://docs.rs/sideway/0.4) verbs crate
//! (feature `sideway`): sideway's CQs and completion channels go into
//! rdmasafe's [`CqLoop`], and sideway's QPs connect through rdmasafe's
//! [`CmId`]s. rdmasafe does the event paths (CM events copied and acked at
//! once, CQ events armed, read, acked and drained in the race-free order);
//! sideway does the data path (its post-send guards, `ibv_wr_*` on extended
//! QPs, RDMA WRITE with immediate, READ, atomics). User code needs no raw
//! pointer and no `unsafe`: every `unsafe` of the glue is in this module.
//!
//! Why it is built this way (docs/interop.md has the evaluation):
//!
//! * sideway has no constructor from a raw `ibv_context`, so it cannot wrap
//!   the context librdmacm opened for the id (`id->verbs`).
//!   [`open_device`] opens a sideway context of its own on the id's device
//!   instead; a QP there connects through the id all the same, because a
//!   CM id never needs to own the QP: `rdma_init_qp_attr` gives the
//!   attributes of each state for the id's route, the QP is moved with
//!   sideway's `modify`, and the QP number travels in the connect/accept
//!   parameters ([`Qp::connect`], [`Qp::establish`], [`Qp::accept`]). This
//!   is how librdmacm itself moves a QP it owns (`ucma_modify_qp_rtr`,
//!   `ucma_modify_qp_rts` in `librdmacm/cma.c`), and the sequence sideway's
//!   own `cmtime` example uses with sideway's CM ids.
//!   A context of sideway's own also stays open until sideway drops it,
//!   whatever librdmacm does with its context after a device removal.
//! * sideway creates CQs on its own completion channels
//!   (`CompletionQueueBuilder::setup_comp_channel`) and lends their raw
//!   handles: [`CompletionLoop`] runs a [`CqLoop`] on a sideway channel and
//!   takes sideway CQs, keeping each alive while it is in the loop, and
//!   the channel while the loop lives.
//! * sideway's memory registration and scatter/gather entries are `unsafe`
//!   (the caller vouches for the buffer's lifetime). [`Buffer`] is memory
//!   rdmasafe allocates and registers, and [`Qp`] keeps every buffer a work
//!   request was posted with alive until the QP is destroyed, so the safe
//!   posting methods of [`Qp`] can hand sideway the entries.
//!
//! Teardown: [`Qp::disconnect`] moves the QP to the error state (flushing
//! what is outstanding, as librdmacm does for a QP it owns) and calls
//! `rdma_disconnect`. Drop the QPs, then the loop (it acks every event it
//! read), then the CQs; ids may go at any point, they do not own the QPs.
//!
//! ```no_run
//! use rdmasafe_core::cm::{ConnectParams, EventChannel, PortSpace};
//! use rdmasafe_core::cq::LoopOptions;
//! use rdmasafe_core::sideway::{open_device, CompletionLoop, Qp};
//! use rdmasafe_core::sideway::sideway::ibverbs::completion::{CompletionChannel, GenericCompletionQueue};
//!
//! # fn main() -> rdmasafe_core::Result<()> {
//! let ch = EventChannel::new()?;
//! let id = ch.create_id(PortSpace::Tcp)?;
//! // ... resolve_addr / resolve_route, as with any rdmasafe id ...
//! let ctx = open_device(&id)?;
//! let chan = CompletionChannel::new(&ctx).expect("channel");
//! let cq = GenericCompletionQueue::from(
//!     ctx.create_cq_builder().setup_cqe(64).setup_comp_channel(&chan, 0).build().expect("cq"),
//! );
//! let lp = CompletionLoop::new(&chan, LoopOptions::default())?;
//! lp.add_cq(&cq, |wcs, _ctl| {
//!     for wc in wcs {
//!         println!("wr {} {}", wc.wr_id(), wc.status());
//!     }
//! })?;
//! let pd = ctx.alloc_pd().expect("pd");
//! let qp = pd.create_qp_builder().setup_send_cq(cq.clone()).setup_recv_cq(cq.clone()).build_ex().expect("qp");
//! let mut qp = Qp::new(qp);
//! qp.connect(&id, &ConnectParams::default())?; // then Qp::establish on CONNECT_RESPONSE
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock, Weak};

pub use ::sideway;
use ::sideway::ibverbs::completion::{CompletionChannel, CompletionQueue as _, GenericCompletionQueue};
use ::sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use ::sideway::ibverbs::device_context::DeviceContext;
use ::sideway::ibverbs::memory_region::MemoryRegion;
use ::sideway::ibverbs::protection_domain::ProtectionDomain;
use ::sideway::ibverbs::queue_pair::{
    PostSendGuard as _, QueuePair, QueuePairAttribute, QueuePairState, SetScatterGatherEntry as _, WorkRequestFlags,
};
use ::sideway::ibverbs::AccessFlags;

use crate::cm::{CmId, ConnectParams, ConnectRequest, SendOptions};
use crate::cq::{CqLoop, CqOptions, LoopControl, LoopOptions, LoopStats, LoopThread, Outcome};
use crate::wc::Wc;
use crate::{Error, Result};

/// The errno inside a sideway error (its `source()` chain ends in an
/// `io::Error`), or EIO.
fn errno_of(e: &(dyn std::error::Error + 'static)) -> i32 {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return io.raw_os_error().unwrap_or(libc::EIO);
        }
        cur = err.source();
    }
    libc::EIO
}

fn sw_err<E: std::error::Error + 'static>(op: &'static str) -> impl FnOnce(E) -> Error {
    move |e| {
        log::debug!(target: "rdmasafe", "{op}: sideway: {e}");
        Error::new(op, errno_of(&e))
    }
}

/// Contexts opened by [`open_device`], by device name, while a clone lives.
fn contexts() -> &'static Mutex<HashMap<String, Weak<DeviceContext>>> {
    static M: OnceLock<Mutex<HashMap<String, Weak<DeviceContext>>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

/// A sideway device context on the device `id` is bound to (after
/// `bind_addr` or `resolve_addr`): the same context for every id on that
/// device while any clone of it lives, opened with sideway's
/// `Device::open` (sideway cannot wrap librdmacm's own context, see the
/// module docs). Build the PD, completion channel, CQs and QPs for the id's
/// connection on it. Errors: EINVAL before the id is bound to a device,
/// ENODEV if libibverbs does not list the id's device.
pub fn open_device(id: &CmId) -> Result<Arc<DeviceContext>> {
    let name = id.device_context()?.name();
    let mut map = contexts().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(ctx) = map.get(&name).and_then(Weak::upgrade) {
        return Ok(ctx);
    }
    let list = DeviceList::new().map_err(sw_err("ibv_get_device_list"))?;
    let dev = list
        .iter()
        .find(|d| d.name() == name)
        .ok_or(Error::new("open_device: the id's device is not listed by libibverbs", libc::ENODEV))?;
    let ctx = dev.open().map_err(sw_err("ibv_open_device"))?;
    map.retain(|_, w| w.strong_count() > 0);
    map.insert(name, Arc::downgrade(&ctx));
    Ok(ctx)
}

/// The raw CQ of a sideway CQ, in rdma-sys's type (the same C object).
fn raw_cq(cq: &GenericCompletionQueue) -> NonNull<crate::sys::ibv_cq> {
    // SAFETY: reading the handle only; the caller keeps `cq` (an Arc) alive
    // for as long as the pointer is used.
    unsafe { cq.cq() }.cast()
}

/// Adding and removing sideway CQs through a [`LoopControl`], from any
/// thread or from a handler (see [`LoopControl::add_cq`] for the outcomes).
pub trait SidewayControl {
    /// Adds a sideway CQ created on the loop's channel; the loop keeps a
    /// clone of it (so the CQ lives) until it is removed or the loop is
    /// dropped. EINVAL if the CQ is on another channel, EBUSY if it is in
    /// a loop already.
    fn add_sideway_cq<F>(&self, cq: &GenericCompletionQueue, opts: CqOptions, handler: F) -> Result<Outcome>
    where
        F: FnMut(&[Wc], &LoopControl) + Send + 'static;

    /// Removes a sideway CQ ([`LoopControl::remove_cq`]): its events are
    /// read and acked and its handler dropped, with the loop's clone of
    /// the CQ.
    fn remove_sideway_cq(&self, cq: &GenericCompletionQueue) -> Result<Outcome>;
}

impl SidewayControl for LoopControl {
    fn add_sideway_cq<F>(&self, cq: &GenericCompletionQueue, opts: CqOptions, mut handler: F) -> Result<Outcome>
    where
        F: FnMut(&[Wc], &LoopControl) + Send + 'static,
    {
        let keep = cq.clone();
        let raw = raw_cq(cq);
        // The loop drops the handler (and with it this clone of the CQ) only
        // after the CQ is out of the loop, its events acked: the CQ outlives
        // every use the loop makes of it, as add_raw_cq requires.
        let h = Box::new(move |wcs: &[Wc], ctl: &LoopControl| {
            let _alive = &keep;
            handler(wcs, ctl)
        });
        // SAFETY: `raw` stays alive while the handler holds `keep` (above);
        // if the add fails the handler is dropped and the CQ is not in the
        // loop.
        unsafe { self.add_raw_cq(raw, opts, h) }
    }

    fn remove_sideway_cq(&self, cq: &GenericCompletionQueue) -> Result<Outcome> {
        self.remove_raw_cq(raw_cq(cq).as_ptr())
    }
}

/// rdmasafe's [`CqLoop`] on a sideway completion channel, taking sideway
/// CQs. Everything the loop does (arm, read events, ack them on the CQ they
/// name, in batches, re-arm before the final drain, several CQs on one
/// channel, live add/remove, stop) is the [`CqLoop`]'s; handlers get
/// rdmasafe's [`Wc`]s. The loop is the only reader of the channel and the
/// only poller of its CQs: do not poll them with sideway's `start_poll`.
pub struct CompletionLoop {
    // Dropped first: the loop acks what it read before the channel can go.
    lp: CqLoop,
    _channel: Arc<CompletionChannel>,
}

impl CompletionLoop {
    /// A loop on `channel` (kept alive by the loop).
    pub fn new(channel: &Arc<CompletionChannel>, opts: LoopOptions) -> Result<CompletionLoop> {
        // SAFETY: reading the handle only; the loop keeps the channel alive.
        let raw = unsafe { channel.comp_channel() }.cast();
        // SAFETY: the channel is live and outlives the loop: this value holds
        // an Arc of it and drops the loop first.
        let lp = unsafe { CqLoop::from_raw(raw, opts) }?;
        Ok(CompletionLoop { lp, _channel: channel.clone() })
    }

    /// Adds a sideway CQ with the loop's default options; see
    /// [`SidewayControl::add_sideway_cq`].
    pub fn add_cq<F>(&self, cq: &GenericCompletionQueue, handler: F) -> Result<()>
    where
        F: FnMut(&[Wc], &LoopControl) + Send + 'static,
    {
        self.add_cq_with(cq, self.lp.default_cq_options(), handler)
    }

    /// Adds a sideway CQ with its own options.
    pub fn add_cq_with<F>(&self, cq: &GenericCompletionQueue, opts: CqOptions, handler: F) -> Result<()>
    where
        F: FnMut(&[Wc], &LoopControl) + Send + 'static,
    {
        self.lp.control().add_sideway_cq(cq, opts, handler).map(|_| ())
    }

    /// Removes a sideway CQ; see [`SidewayControl::remove_sideway_cq`].
    pub fn remove_cq(&self, cq: &GenericCompletionQueue) -> Result<()> {
        self.lp.control().remove_sideway_cq(cq).map(|_| ())
    }

    /// The loop itself: run it, embed it ([`CqLoop::process_once`], its fd),
    /// drain QPs, read its figures.
    pub fn cq_loop(&self) -> &CqLoop {
        &self.lp
    }

    /// [`CqLoop::run`].
    pub fn run(&self) -> Result<()> {
        self.lp.run()
    }

    /// [`CqLoop::control`].
    pub fn control(&self) -> LoopControl {
        self.lp.control()
    }

    /// [`CqLoop::stats`].
    pub fn stats(&self) -> LoopStats {
        self.lp.stats()
    }

    /// Runs the loop on a thread of its own ([`CqLoop::spawn`]).
    pub fn spawn(self, cpu: Option<usize>) -> Result<CompletionLoopThread> {
        let CompletionLoop { lp, _channel } = self;
        Ok(CompletionLoopThread { thread: lp.spawn(cpu)?, _channel })
    }
}

/// A [`CompletionLoop`] running on its own thread.
pub struct CompletionLoopThread {
    thread: LoopThread,
    _channel: Arc<CompletionChannel>,
}

impl CompletionLoopThread {
    /// The loop's control handle.
    pub fn control(&self) -> LoopControl {
        self.thread.control()
    }

    /// Stops the loop, joins its thread and gives the loop back
    /// ([`LoopThread::stop`]).
    pub fn stop(self) -> Result<CompletionLoop> {
        let CompletionLoopThread { thread, _channel } = self;
        Ok(CompletionLoop { lp: thread.stop()?, _channel })
    }
}

struct BufferInner {
    /// Taken (deregistered) before the memory is freed.
    mr: Option<Arc<MemoryRegion>>,
    mem: NonNull<u8>,
    len: usize,
}

// SAFETY: the memory is only reached through volatile copies (see Buffer);
// MR calls are thread-safe.
unsafe impl Send for BufferInner {}
// SAFETY: as above.
unsafe impl Sync for BufferInner {}

impl Drop for BufferInner {
    fn drop(&mut self) {
        // Deregister first: after ibv_dereg_mr the device no longer reaches
        // the memory, so freeing it is safe.
        drop(self.mr.take());
        // SAFETY: leaked from a Box<[u8]> of `len` bytes in Buffer::new and
        // freed exactly once, here.
        unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.mem.as_ptr(), self.len))) };
    }
}

/// Memory rdmasafe allocates and registers with a sideway PD (local write,
/// remote read and write), for sideway QPs to post from and into.
///
/// The device reads and writes it on its own (DMA), outside anything Rust
/// can see, so its bytes are reached only by volatile copies ([`read`],
/// [`write`]); writing needs `&mut`, and the type is not `Clone`. A [`Qp`]
/// that posted a work request with it keeps the memory and its
/// registration alive until the QP is dropped.
///
/// [`read`]: Buffer::read
/// [`write`]: Buffer::write
pub struct Buffer(Arc<BufferInner>);

impl Buffer {
    /// Allocates `len` zeroed bytes (at least one) and registers them
    /// (`ibv_reg_mr`) on `pd`.
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize) -> Result<Buffer> {
        let boxed: Box<[u8]> = vec![0u8; len.max(1)].into_boxed_slice();
        let len = boxed.len();
        let mem = NonNull::new(Box::into_raw(boxed).cast::<u8>()).expect("Box is never NULL");
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        // SAFETY: mem..mem+len is our allocation; it stays allocated until
        // the MR is deregistered (BufferInner::drop).
        match unsafe { pd.reg_mr(mem.as_ptr() as usize, len, access) } {
            Ok(mr) => Ok(Buffer(Arc::new(BufferInner { mr: Some(mr), mem, len }))),
            Err(e) => {
                // SAFETY: undo the leak above; nothing registered it.
                unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(mem.as_ptr(), len))) };
                Err(sw_err("ibv_reg_mr")(e))
            }
        }
    }

    fn mr(&self) -> &MemoryRegion {
        self.0.mr.as_ref().expect("registered until dropped")
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// True if the buffer is empty (never: at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.mr().lkey()
    }

    /// What a peer needs to reach the bytes `offset..offset + len` of this
    /// buffer with RDMA READ or WRITE. EINVAL if the range is out of bounds.
    pub fn remote(&self, offset: usize, len: usize) -> Result<RemoteBuffer> {
        self.range(offset, len, "Buffer::remote")?;
        Ok(RemoteBuffer { addr: self.0.mem.as_ptr() as u64 + offset as u64, rkey: self.mr().rkey(), len: len as u64 })
    }

    fn range(&self, offset: usize, n: usize, op: &'static str) -> Result<*mut u8> {
        offset.checked_add(n).filter(|e| *e <= self.0.len).ok_or(Error::new(op, libc::EINVAL))?;
        // SAFETY: in bounds (checked).
        Ok(unsafe { self.0.mem.as_ptr().add(offset) })
    }

    /// Address and length of `offset..offset + len` for an SGE.
    fn sge(&self, offset: usize, len: u32, op: &'static str) -> Result<(u64, u32)> {
        let p = self.range(offset, len as usize, op)?;
        Ok((p as u64, len))
    }

    /// Copies `dst.len()` bytes out of the buffer at `offset` (volatile
    /// reads: the device may have written them).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let p = self.range(offset, dst.len(), "Buffer::read")?;
        for (i, d) in dst.iter_mut().enumerate() {
            // SAFETY: in bounds; the memory lives as long as self.
            *d = unsafe { p.add(i).read_volatile() };
        }
        Ok(())
    }

    /// Copies `src` into the buffer at `offset` (volatile writes: the
    /// device may read them at any time).
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        let p = self.range(offset, src.len(), "Buffer::write")?;
        for (i, b) in src.iter().enumerate() {
            // SAFETY: in bounds; the memory lives as long as self, and
            // &mut self excludes every other Rust access.
            unsafe { p.add(i).write_volatile(*b) };
        }
        Ok(())
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({} bytes at {:p})", self.0.len, self.0.mem)
    }
}

/// A peer's registered range for RDMA READ and WRITE: address, remote key
/// and length, as the peer's [`Buffer::remote`] gave them. 20 bytes on the
/// wire ([`RemoteBuffer::to_bytes`]), so it fits the private data of a
/// connect (56 bytes) or an accept (196).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteBuffer {
    /// The range's first byte in the peer's address space.
    pub addr: u64,
    /// The peer MR's remote key.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteBuffer {
    /// Size of [`RemoteBuffer::to_bytes`].
    pub const WIRE_LEN: usize = 20;

    /// Little-endian `addr`, `rkey`, `len`.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0u8; Self::WIRE_LEN];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        b[12..].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Reads what [`RemoteBuffer::to_bytes`] wrote (the first
    /// [`RemoteBuffer::WIRE_LEN`] bytes; received private data is padded).
    pub fn from_bytes(b: &[u8]) -> Option<RemoteBuffer> {
        let b = b.get(..Self::WIRE_LEN)?;
        Some(RemoteBuffer {
            addr: u64::from_le_bytes(b[..8].try_into().ok()?),
            rkey: u32::from_le_bytes(b[8..12].try_into().ok()?),
            len: u64::from_le_bytes(b[12..].try_into().ok()?),
        })
    }

    /// The remote address of `offset..offset + len`; EINVAL out of bounds.
    fn at(&self, offset: u64, len: u32, op: &'static str) -> Result<u64> {
        offset.checked_add(len as u64).filter(|e| *e <= self.len).ok_or(Error::new(op, libc::EINVAL))?;
        Ok(self.addr + offset)
    }
}

/// `rdma_init_qp_attr` for `state` on `id`, as sideway's attribute type.
fn cm_qp_attr(id: &CmId, state: QueuePairState) -> Result<QueuePairAttribute> {
    // SAFETY: ibv_qp_attr is plain data; zero is valid.
    let mut attr: rdma_mummy_sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = state as _;
    let mut mask = 0;
    // SAFETY: a live id (the pointer is only passed to librdmacm, whose
    // struct rdma_cm_id both bindings describe); attr and mask are valid
    // out-parameters.
    if unsafe { rdma_mummy_sys::rdma_init_qp_attr(id.raw().cast(), &mut attr, &mut mask) } != 0 {
        return Err(Error::last("rdma_init_qp_attr"));
    }
    if state == QueuePairState::ReadyToReceive && port_is_infiniband(id) {
        // librdmacm masks these bits off on InfiniBand ports (its
        // ucma_modify_qp_rtr: "Workaround for rdma_ucm kernel bug", bits
        // 21-24 are meant for RoCE).
        mask &= !0x00e0_0000;
    }
    Ok(QueuePairAttribute::from(&attr, mask))
}

fn port_is_infiniband(id: &CmId) -> bool {
    let Ok(ctx) = id.device_context() else { return false };
    // SAFETY: ibv_port_attr is plain data; zero is valid.
    let mut attr: rdma_sys::ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: a live context (ctx holds it open) and a valid out-parameter.
    let r = unsafe { rdma_sys::___ibv_query_port(ctx.raw(), id.port_num(), &mut attr) };
    r == 0 && attr.link_layer == IBV_LINK_LAYER_INFINIBAND
}

/// `IBV_LINK_LAYER_INFINIBAND` of verbs.h (an anonymous enum rdma-sys does
/// not bind).
const IBV_LINK_LAYER_INFINIBAND: u8 = 1;

/// A sideway QP connected through an rdmasafe [`CmId`], and a safe front
/// for posting on it with [`Buffer`]s. The QP stays sideway's: reach it
/// with [`Qp::inner`] / [`Qp::inner_mut`] for anything sideway offers.
///
/// Every buffer a work request was posted with is kept (memory and
/// registration) until the `Qp` is dropped, after the QP is destroyed: the
/// device may touch a buffer until then.
pub struct Qp<Q: QueuePair> {
    // Dropped first: ibv_destroy_qp before the buffers go.
    qp: Q,
    kept: Vec<Arc<BufferInner>>,
}

/// Which one-sided operation `Qp::post_rdma` posts.
#[derive(Clone, Copy)]
enum Rdma {
    Write,
    WriteImm(u32),
    Read,
}

impl<Q: QueuePair> Qp<Q> {
    /// Takes a sideway QP (RC, in the RESET state, made on a context from
    /// [`open_device`] for the id it will connect through).
    pub fn new(qp: Q) -> Qp<Q> {
        Qp { qp, kept: Vec::new() }
    }

    /// The sideway QP.
    pub fn inner(&self) -> &Q {
        &self.qp
    }

    /// The sideway QP, to post or modify with sideway's own API.
    pub fn inner_mut(&mut self) -> &mut Q {
        &mut self.qp
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp.qp_number()
    }

    fn modify_to(
        &mut self,
        id: &CmId,
        state: QueuePairState,
        tweak: impl FnOnce(&mut QueuePairAttribute),
    ) -> Result<()> {
        let mut attr = cm_qp_attr(id, state)?;
        tweak(&mut attr);
        self.qp.modify(&attr).map_err(sw_err("ibv_modify_qp"))
    }

    /// Active side, after ROUTE_RESOLVED: moves the QP to INIT with the
    /// id's attributes and connects (`rdma_connect`) with this QP's number.
    /// Then wait for CONNECT_RESPONSE (the id has no QP of its own, so
    /// librdmacm reports the response instead of ESTABLISHED) and call
    /// [`Qp::establish`].
    pub fn connect(&mut self, id: &CmId, params: &ConnectParams<'_>) -> Result<()> {
        self.modify_to(id, QueuePairState::Init, |_| {})?;
        id.connect(&ConnectParams { qp_num: self.qp_num(), ..*params })
    }

    /// Active side, on CONNECT_RESPONSE: INIT again (the access flags the
    /// connection agreed on), RTR, RTS with the id's attributes, then
    /// `rdma_establish`. The QP may send once this returns. On failure the
    /// QP is moved to the error state (as librdmacm does).
    pub fn establish(&mut self, id: &CmId) -> Result<()> {
        let r = self
            .modify_to(id, QueuePairState::Init, |_| {})
            .and_then(|_| self.modify_to(id, QueuePairState::ReadyToReceive, |_| {}))
            .and_then(|_| self.modify_to(id, QueuePairState::ReadyToSend, |_| {}))
            .and_then(|_| {
                // SAFETY: a live id without a QP of its own, as
                // rdma_establish requires.
                match unsafe { rdma_sys::rdma_establish(id.raw()) } {
                    0 => Ok(()),
                    _ => Err(Error::last("rdma_establish")),
                }
            });
        if r.is_err() {
            let _ = self.to_error();
        }
        r
    }

    /// Passive side, on CONNECT_REQUEST: moves the QP to INIT, RTR
    /// (`max_dest_rd_atomic` = `params.responder_resources`) and RTS
    /// (`max_rd_atomic` = `params.initiator_depth`) with the request's
    /// attributes, then accepts with this QP's number and hands over the
    /// connected id (ESTABLISHED follows on it). On failure the request is
    /// rejected, the id destroyed and the QP moved to the error state.
    ///
    /// A QP in the RESET state takes no receives (EINVAL): to have receives
    /// posted before the peer can send, use [`Qp::accept_with`].
    pub fn accept(&mut self, req: ConnectRequest, params: &ConnectParams<'_>) -> Result<CmId> {
        self.accept_with(req, params, |_| Ok(()))
    }

    /// [`Qp::accept`], calling `ready` once the QP is in RTS and before
    /// `rdma_accept`: post the receives there, so they are in place before
    /// the peer learns the connection is accepted. An error from `ready`
    /// rejects the request as a failed transition would.
    pub fn accept_with<F>(&mut self, mut req: ConnectRequest, params: &ConnectParams<'_>, ready: F) -> Result<CmId>
    where
        F: FnOnce(&mut Self) -> Result<()>,
    {
        let id = req.id_mut();
        let prepared = self
            .modify_to(id, QueuePairState::Init, |_| {})
            .and_then(|_| {
                self.modify_to(id, QueuePairState::ReadyToReceive, |a| {
                    a.setup_max_dest_read_atomic(params.responder_resources);
                })
            })
            .and_then(|_| {
                self.modify_to(id, QueuePairState::ReadyToSend, |a| {
                    a.setup_max_read_atomic(params.initiator_depth);
                })
            })
            .and_then(|_| ready(self));
        let r = match prepared {
            Ok(()) => req.accept(&ConnectParams { qp_num: self.qp_num(), ..*params }),
            Err(e) => {
                let _ = req.reject(&[]);
                Err(e)
            }
        };
        if r.is_err() {
            let _ = self.to_error();
        }
        r
    }

    /// Moves the QP to the error state: everything outstanding completes
    /// (flushed) on its CQs.
    pub fn to_error(&mut self) -> Result<()> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        self.qp.modify(&attr).map_err(sw_err("ibv_modify_qp(IBV_QPS_ERR)"))
    }

    /// Moves the QP to the error state (flushing what is outstanding) and
    /// disconnects the id (`rdma_disconnect`), as librdmacm does for a QP
    /// it owns. DISCONNECTED follows on both sides.
    pub fn disconnect(&mut self, id: &CmId) -> Result<()> {
        let r = self.to_error();
        id.disconnect()?;
        r
    }

    fn keep(&mut self, buf: &Buffer) {
        if !self.kept.iter().any(|k| Arc::ptr_eq(k, &buf.0)) {
            self.kept.push(buf.0.clone());
        }
    }

    fn flags(opts: SendOptions) -> WorkRequestFlags {
        let mut f = WorkRequestFlags::none();
        if opts.signaled {
            f |= WorkRequestFlags::Signaled;
        }
        if opts.solicited {
            f |= WorkRequestFlags::Solicited;
        }
        if opts.inline {
            f |= WorkRequestFlags::Inline;
        }
        f
    }

    /// Posts one RDMA WRITE with immediate (through sideway's post-send
    /// guard) of `len` bytes at `offset` in `local` to `remote_offset` in
    /// `remote`; the peer gets a receive completion carrying `imm` (it must
    /// have a receive posted, [`Qp::post_recv_empty`] will do). `local` is
    /// kept until the QP is dropped. EINVAL if a range is out of bounds.
    ///
    /// `imm` is in host byte order, as [`Wc::imm_data`] gives it back on the
    /// peer. (sideway's own `setup_write_imm` stores its argument as the
    /// `__be32` of verbs.h unconverted: there a host value arrives
    /// byte-swapped on a little-endian pair; this method converts.)
    #[allow(clippy::too_many_arguments)]
    pub fn post_write_with_imm(
        &mut self,
        wr_id: u64,
        local: &Buffer,
        offset: usize,
        len: u32,
        remote: &RemoteBuffer,
        remote_offset: u64,
        imm: u32,
        opts: SendOptions,
    ) -> Result<()> {
        self.post_rdma(Rdma::WriteImm(imm), wr_id, local, offset, len, remote, remote_offset, opts)
    }

    /// Posts one RDMA WRITE (no immediate, the peer sees no completion).
    #[allow(clippy::too_many_arguments)]
    pub fn post_write(
        &mut self,
        wr_id: u64,
        local: &Buffer,
        offset: usize,
        len: u32,
        remote: &RemoteBuffer,
        remote_offset: u64,
        opts: SendOptions,
    ) -> Result<()> {
        self.post_rdma(Rdma::Write, wr_id, local, offset, len, remote, remote_offset, opts)
    }

    /// Posts one RDMA READ of `len` bytes at `remote_offset` in `remote`
    /// into `offset` in `local` (kept until the QP is dropped).
    #[allow(clippy::too_many_arguments)]
    pub fn post_read(
        &mut self,
        wr_id: u64,
        local: &Buffer,
        offset: usize,
        len: u32,
        remote: &RemoteBuffer,
        remote_offset: u64,
        opts: SendOptions,
    ) -> Result<()> {
        self.post_rdma(Rdma::Read, wr_id, local, offset, len, remote, remote_offset, opts)
    }

    /// The one-sided posts: bounds checked, `local` kept until the QP is
    /// dropped, one SGE.
    #[allow(clippy::too_many_arguments)]
    fn post_rdma(
        &mut self,
        op: Rdma,
        wr_id: u64,
        local: &Buffer,
        offset: usize,
        len: u32,
        remote: &RemoteBuffer,
        remote_offset: u64,
        opts: SendOptions,
    ) -> Result<()> {
        let name = match op {
            Rdma::Write => "ibv_post_send(RDMA_WRITE)",
            Rdma::WriteImm(_) => "ibv_post_send(RDMA_WRITE_WITH_IMM)",
            Rdma::Read => "ibv_post_send(RDMA_READ)",
        };
        let (addr, len) = local.sge(offset, len, name)?;
        let raddr = remote.at(remote_offset, len, name)?;
        self.keep(local);
        let lkey = local.lkey();
        let mut guard = self.qp.start_post_send();
        let wr = guard.construct_wr(wr_id, Self::flags(opts));
        // SAFETY (each arm): the memory is registered with lkey and stays
        // allocated and registered until this QP is destroyed (kept above);
        // for a READ the device writes into it.
        match op {
            Rdma::Write => unsafe { wr.setup_write(remote.rkey, raddr).setup_sge(lkey, addr, len) },
            Rdma::WriteImm(imm) => unsafe {
                wr.setup_write_imm(remote.rkey, raddr, imm.to_be()).setup_sge(lkey, addr, len)
            },
            Rdma::Read => unsafe { wr.setup_read(remote.rkey, raddr).setup_sge(lkey, addr, len) },
        };
        guard.post().map_err(sw_err(name))
    }

    /// Posts one SEND of `len` bytes at `offset` in `local`.
    pub fn post_send(&mut self, wr_id: u64, local: &Buffer, offset: usize, len: u32, opts: SendOptions) -> Result<()> {
        const OP: &str = "ibv_post_send(SEND)";
        let (addr, len) = local.sge(offset, len, OP)?;
        self.keep(local);
        let lkey = local.lkey();
        let mut guard = self.qp.start_post_send();
        let wr = guard.construct_wr(wr_id, Self::flags(opts)).setup_send();
        // SAFETY: as in post_write_with_imm.
        unsafe { wr.setup_sge(lkey, addr, len) };
        guard.post().map_err(sw_err(OP))
    }

    /// Posts one receive of `len` bytes at `offset` in `local` (kept until
    /// the QP is dropped).
    pub fn post_recv(&mut self, wr_id: u64, local: &Buffer, offset: usize, len: u32) -> Result<()> {
        const OP: &str = "ibv_post_recv";
        let (addr, len) = local.sge(offset, len, OP)?;
        self.keep(local);
        let lkey = local.lkey();
        let mut guard = self.qp.start_post_recv();
        let wr = guard.construct_wr(wr_id);
        // SAFETY: as in post_write_with_imm (the device writes into it).
        unsafe { wr.setup_sge(lkey, addr, len) };
        guard.post().map_err(sw_err(OP))
    }

    /// Posts one receive without a buffer: enough for an RDMA WRITE with
    /// immediate, whose data goes where the writer said.
    pub fn post_recv_empty(&mut self, wr_id: u64) -> Result<()> {
        let mut guard = self.qp.start_post_recv();
        guard.construct_wr(wr_id);
        guard.post().map_err(sw_err("ibv_post_recv"))
    }
}

impl<Q: QueuePair> std::fmt::Debug for Qp<Q> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Qp(qp_num {}, {} buffers kept)", self.qp_num(), self.kept.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_buffer_round_trips_and_checks_bounds() {
        let r = RemoteBuffer { addr: 0x1122_3344_5566_7788, rkey: 0xdead_beef, len: 4096 };
        let mut wire = r.to_bytes().to_vec();
        wire.resize(56, 0); // a connect request's padded private data
        assert_eq!(RemoteBuffer::from_bytes(&wire), Some(r));
        assert_eq!(RemoteBuffer::from_bytes(&wire[..RemoteBuffer::WIRE_LEN - 1]), None);
        assert_eq!(r.at(4000, 96, "t").unwrap(), r.addr + 4000);
        assert_eq!(r.at(4000, 97, "t").unwrap_err().errno(), libc::EINVAL);
        assert_eq!(r.at(u64::MAX, 1, "t").unwrap_err().errno(), libc::EINVAL);
    }

    #[test]
    fn sideway_errors_keep_their_errno() {
        let e = ::sideway::ibverbs::queue_pair::ModifyQueuePairError::from(
            ::sideway::ibverbs::queue_pair::ModifyQueuePairErrorKind::Ibverbs(std::io::Error::from_raw_os_error(
                libc::EPERM,
            )),
        );
        assert_eq!(sw_err("ibv_modify_qp")(e).errno(), libc::EPERM);
    }
}
