//! Owned CM ids and connection requests.

use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::os::raw::c_void;
use std::ptr::{null_mut, NonNull};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::channel::{ChannelInner, EventChannel};
use crate::cq::handle::{LiveQp, QpLife};
use crate::sys::{self, ibv_qp_type, rdma_cm_id, rdma_conn_param, rdma_port_space};
use crate::verbs::{Cq, DeviceContext, Mr, MrInner, Pd, RemoteMr};
use crate::{Error, Result};

/// A number naming one [`CmId`] for its whole life, never reused in the
/// process. On rdmasafe-created channels it is the id's `context`, so every
/// event names its id by token ([`super::CmEvent::token`]): route events
/// with it, without holding pointers that could dangle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdToken(NonZeroU64);

impl IdToken {
    pub(crate) fn next() -> IdToken {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        IdToken(NonZeroU64::new(NEXT.fetch_add(1, Relaxed)).expect("token counter starts at 1"))
    }

    pub(crate) fn from_context(ctx: usize) -> Option<IdToken> {
        NonZeroU64::new(ctx as u64).map(IdToken)
    }

    pub(crate) fn as_context(self) -> usize {
        self.0.get() as usize
    }

    /// The token's number.
    pub fn get(self) -> u64 {
        self.0.get()
    }
}

/// `enum rdma_port_space`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortSpace {
    /// Reliable connected (RC QPs).
    Tcp,
    /// Unreliable datagram (UD QPs).
    Udp,
    /// Any QP type, IB port space.
    Ib,
    /// IPoIB.
    Ipoib,
}

impl PortSpace {
    fn raw(self) -> rdma_port_space::Type {
        match self {
            PortSpace::Tcp => rdma_port_space::RDMA_PS_TCP,
            PortSpace::Udp => rdma_port_space::RDMA_PS_UDP,
            PortSpace::Ib => rdma_port_space::RDMA_PS_IB,
            PortSpace::Ipoib => rdma_port_space::RDMA_PS_IPOIB,
        }
    }
}

/// Parameters of `rdma_connect` / `rdma_accept`.
#[derive(Clone, Copy, Debug)]
pub struct ConnectParams<'a> {
    /// Private data to send (at most 255 bytes here; the transport's limit
    /// is lower: 56 for a connect and 196 for an accept on RoCE/IB).
    pub private_data: &'a [u8],
    /// Outstanding RDMA reads/atomics we accept as responder.
    pub responder_resources: u8,
    /// Outstanding RDMA reads/atomics we issue.
    pub initiator_depth: u8,
    /// Transport retries (7 means "forever" on rxe: a dead peer is then
    /// never reported; the default is 6).
    pub retry_count: u8,
    /// RNR retries (7 = infinite, the default).
    pub rnr_retry_count: u8,
    /// For UD ids: the QP number to report; 0 for RC (librdmacm fills it).
    pub qp_num: u32,
}

impl Default for ConnectParams<'_> {
    fn default() -> Self {
        ConnectParams {
            private_data: &[],
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 6,
            rnr_retry_count: 7,
            qp_num: 0,
        }
    }
}

impl ConnectParams<'_> {
    fn to_raw(self, op: &'static str) -> Result<rdma_conn_param> {
        let len = u8::try_from(self.private_data.len()).map_err(|_| Error::new(op, libc::EINVAL))?;
        Ok(rdma_conn_param {
            private_data: if len == 0 { std::ptr::null() } else { self.private_data.as_ptr().cast() },
            private_data_len: len,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: 1,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: 0,
            qp_num: self.qp_num,
        })
    }
}

/// Sizes of a QP made with [`CmId::create_qp`].
#[derive(Clone, Copy, Debug)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per WR.
    pub max_sge: u32,
    /// Inline data bytes.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps { max_send_wr: 64, max_recv_wr: 64, max_sge: 1, max_inline_data: 0 }
    }
}

/// How a work request is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendOptions {
    /// Ask for a completion (`IBV_SEND_SIGNALED`). Without it the request
    /// completes silently (errors still complete), and the send queue slot
    /// is freed by the next signaled completion.
    pub signaled: bool,
    /// Set the solicited event bit (`IBV_SEND_SOLICITED`): wakes a peer CQ
    /// armed for solicited completions only.
    pub solicited: bool,
    /// Send the data inline (`IBV_SEND_INLINE`), up to the QP's
    /// `max_inline_data`.
    pub inline: bool,
}

impl Default for SendOptions {
    fn default() -> Self {
        SendOptions { signaled: true, solicited: false, inline: false }
    }
}

impl SendOptions {
    fn flags(&self) -> u32 {
        use sys::ibv_send_flags as F;
        let mut f = 0;
        if self.signaled {
            f |= F::IBV_SEND_SIGNALED.0;
        }
        if self.solicited {
            f |= F::IBV_SEND_SOLICITED.0;
        }
        if self.inline {
            f |= F::IBV_SEND_INLINE.0;
        }
        f
    }
}

/// One send-queue work request.
struct Post {
    opcode: u32,
    sge: Option<sys::ibv_sge>,
    wr_id: u64,
    opts: SendOptions,
    imm: Option<u32>,
    remote: Option<RemoteMr>,
}

impl Post {
    const NONE: Post = Post {
        opcode: sys::ibv_wr_opcode::IBV_WR_SEND,
        sge: None,
        wr_id: 0,
        opts: SendOptions { signaled: true, solicited: false, inline: false },
        imm: None,
        remote: None,
    };
}

/// `ibv_post_send` of one request.
///
/// # Safety
/// `qp` is a live QP; the SGE's memory is registered (or, inline, valid
/// for the call) and stays so until the request completes.
unsafe fn post_one(qp: *mut sys::ibv_qp, p: Post) -> Result<()> {
    let mut sge = p.sge;
    // SAFETY: ibv_send_wr is plain data; zero is valid.
    let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = p.wr_id;
    if let Some(s) = sge.as_mut() {
        wr.sg_list = s;
        wr.num_sge = 1;
    }
    wr.opcode = p.opcode;
    wr.send_flags = p.opts.flags();
    if let Some(imm) = p.imm {
        wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
    }
    if let Some(r) = p.remote {
        wr.wr.rdma = sys::rdma_t { remote_addr: r.addr, rkey: r.rkey };
    }
    let mut bad = null_mut();
    // SAFETY: live QP (caller); wr and sge valid for the call.
    let r = unsafe { sys::ibv_post_send(qp, &mut wr, &mut bad) };
    if r == 0 {
        Ok(())
    } else {
        Err(Error::new("ibv_post_send", r))
    }
}

/// What a QP needs alive as long as it exists: its PD, CQs, and every MR a
/// work request was ever posted with (the device may touch their memory
/// until the QP is destroyed).
struct QpParts {
    /// Cleared before the QP is destroyed (a loop's keepalive or drain on
    /// it checks).
    life: Arc<QpLife>,
    _pd: Pd,
    _send_cq: Cq,
    _recv_cq: Cq,
    mrs: Mutex<Vec<Arc<MrInner>>>,
}

/// An owned `rdma_cm_id`. Dropping it destroys its QP (if any) and the id.
///
/// Dropping never waits on rdmasafe: events for the id were acked when they
/// were copied, so `rdma_destroy_id` only waits for the kernel.
pub struct CmId {
    raw: NonNull<rdma_cm_id>,
    token: IdToken,
    qp: Option<QpParts>,
    // Keeps the channel alive while the id exists; dropped after the id.
    _channel: Arc<ChannelInner>,
}

// SAFETY: the id is used by one thread at a time (the type is not Sync:
// librdmacm does not make concurrent calls on one id safe), and moving it to
// another thread is fine; the rest is owned keep-alives.
unsafe impl Send for CmId {}

fn cvt(op: &'static str, r: i32) -> Result<()> {
    if r == 0 {
        Ok(())
    } else {
        Err(Error::last(op))
    }
}

/// sockaddr storage for librdmacm calls.
fn sockaddr(addr: &SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain data; zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
        }
    }
    ss
}

fn ms(d: Duration) -> i32 {
    d.as_millis().min(i32::MAX as u128) as i32
}

impl CmId {
    /// Creates an id on `channel` (`rdma_create_id`) with its token as
    /// context.
    pub fn new(channel: &EventChannel, ps: PortSpace) -> Result<CmId> {
        let token = IdToken::next();
        let mut raw = null_mut();
        // SAFETY: channel is live; raw receives the new id.
        let r =
            unsafe { sys::rdma_create_id(channel.inner.raw(), &mut raw, token.as_context() as *mut c_void, ps.raw()) };
        cvt("rdma_create_id", r)?;
        let raw = NonNull::new(raw).ok_or(Error::new("rdma_create_id", libc::EIO))?;
        Ok(CmId { raw, token, qp: None, _channel: channel.inner.clone() })
    }

    /// Wraps the new id of a CONNECT_REQUEST.
    ///
    /// # Safety
    /// `raw` must be the live new id of a connect request on `channel`,
    /// owned by no one else, with `token` already set as its context.
    pub(crate) unsafe fn from_new_request(raw: *mut rdma_cm_id, token: IdToken, channel: Arc<ChannelInner>) -> CmId {
        CmId { raw: NonNull::new(raw).expect("connect request id is not NULL"), token, qp: None, _channel: channel }
    }

    /// This id's token (also its `context`).
    pub fn token(&self) -> IdToken {
        self.token
    }

    /// The raw id (still owned by this value).
    pub fn raw(&self) -> *mut rdma_cm_id {
        self.raw.as_ptr()
    }

    /// The device context the id is bound to, once an address is bound or
    /// resolved. The context stays open while the returned value or
    /// anything built on it lives, even past this id and a removal of the
    /// device (see [`DeviceContext`]). Errors: EINVAL before the id is bound
    /// to a device, ENODEV if the device was removed already.
    pub fn device_context(&self) -> Result<DeviceContext> {
        // SAFETY: raw is live; reading the verbs field.
        let verbs = NonNull::new(unsafe { (*self.raw.as_ptr()).verbs })
            .ok_or(Error::new("CmId::device_context: not bound to a device yet", libc::EINVAL))?;
        // SAFETY: the verbs of a live id.
        unsafe { DeviceContext::for_cm_id(verbs) }
    }

    /// The id's port number on its device.
    pub fn port_num(&self) -> u8 {
        // SAFETY: raw is live.
        unsafe { (*self.raw.as_ptr()).port_num }
    }

    /// The local port (`rdma_get_src_port`), e.g. after binding port 0.
    pub fn local_port(&self) -> u16 {
        // SAFETY: live id.
        u16::from_be(unsafe { sys::rdma_get_src_port(self.raw()) })
    }

    /// `rdma_bind_addr`.
    pub fn bind_addr(&self, addr: SocketAddr) -> Result<()> {
        let mut ss = sockaddr(&addr);
        // SAFETY: live id; ss is a valid sockaddr for the call.
        cvt("rdma_bind_addr", unsafe {
            sys::rdma_bind_addr(self.raw(), (&mut ss as *mut libc::sockaddr_storage).cast())
        })
    }

    /// `rdma_resolve_addr` (completes with ADDR_RESOLVED or ADDR_ERROR).
    pub fn resolve_addr(&self, src: Option<SocketAddr>, dst: SocketAddr, timeout: Duration) -> Result<()> {
        let mut s = src.map(|a| sockaddr(&a));
        let mut d = sockaddr(&dst);
        let sp = s.as_mut().map_or(null_mut(), |s| (s as *mut libc::sockaddr_storage).cast());
        // SAFETY: live id; address pointers valid for the call.
        cvt("rdma_resolve_addr", unsafe {
            sys::rdma_resolve_addr(self.raw(), sp, (&mut d as *mut libc::sockaddr_storage).cast(), ms(timeout))
        })
    }

    /// `rdma_resolve_route` (completes with ROUTE_RESOLVED or ROUTE_ERROR).
    pub fn resolve_route(&self, timeout: Duration) -> Result<()> {
        // SAFETY: live id.
        cvt("rdma_resolve_route", unsafe { sys::rdma_resolve_route(self.raw(), ms(timeout)) })
    }

    /// `rdma_listen`. The kernel holds at most `backlog` connect requests
    /// that nobody fetched yet; further requests are dropped silently and
    /// their clients end in UNREACHABLE (about 100 s of retries; 102 s
    /// measured on Soft-RoCE). Size it for your bursts.
    pub fn listen(&self, backlog: i32) -> Result<()> {
        // SAFETY: live id.
        cvt("rdma_listen", unsafe { sys::rdma_listen(self.raw(), backlog) })
    }

    /// Creates an RC or UD QP on the id (`rdma_create_qp`), keeping `pd` and
    /// the CQs alive for as long as the QP exists.
    pub fn create_qp(&mut self, pd: &Pd, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps, ud: bool) -> Result<()> {
        if self.qp.is_some() {
            return Err(Error::new("rdma_create_qp", libc::EEXIST));
        }
        // SAFETY: ibv_qp_init_attr is plain data; zero is valid.
        let mut attr: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = send_cq.raw();
        attr.recv_cq = recv_cq.raw();
        attr.qp_type = if ud { ibv_qp_type::IBV_QPT_UD } else { ibv_qp_type::IBV_QPT_RC };
        attr.cap.max_send_wr = caps.max_send_wr;
        attr.cap.max_recv_wr = caps.max_recv_wr;
        attr.cap.max_send_sge = caps.max_sge;
        attr.cap.max_recv_sge = caps.max_sge;
        attr.cap.max_inline_data = caps.max_inline_data;
        attr.sq_sig_all = 0;
        // SAFETY: live id, live pd and CQs (kept alive below), valid attr.
        cvt("rdma_create_qp", unsafe { sys::rdma_create_qp(self.raw(), pd.raw(), &mut attr) })?;
        self.qp = Some(QpParts {
            life: Arc::new(QpLife::new_alive()),
            _pd: pd.clone(),
            _send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
            mrs: Mutex::new(Vec::new()),
        });
        Ok(())
    }

    /// The QP number, if a QP was created.
    pub fn qp_num(&self) -> Option<u32> {
        self.qp.as_ref()?;
        // SAFETY: the QP exists while self.qp is Some.
        Some(unsafe { (*(*self.raw.as_ptr()).qp).qp_num })
    }

    /// The QP for a CQ loop's keepalive or drain, with its life token.
    pub(crate) fn live_qp(&self) -> Option<LiveQp> {
        let parts = self.qp.as_ref()?;
        let raw = self.raw_qp()?;
        // SAFETY: the QP is live now, and `end()` is called before
        // rdma_destroy_qp (Drop), so the loop's uses under the token are
        // always on a live QP.
        Some(unsafe { LiveQp::with_life(raw, parts.life.clone()) })
    }

    /// The raw QP, if one was created (owned by this id).
    pub fn raw_qp(&self) -> Option<NonNull<sys::ibv_qp>> {
        self.qp.as_ref()?;
        // SAFETY: live id; the QP exists while self.qp is Some.
        NonNull::new(unsafe { (*self.raw.as_ptr()).qp })
    }

    /// `rdma_connect`.
    pub fn connect(&self, params: &ConnectParams<'_>) -> Result<()> {
        let mut p = params.to_raw("rdma_connect")?;
        // SAFETY: live id; p and its private data are valid for the call
        // (librdmacm copies the data).
        cvt("rdma_connect", unsafe { sys::rdma_connect(self.raw(), &mut p) })
    }

    /// Moves the id to another rdmasafe channel (`rdma_migrate_id`); later
    /// events of the id arrive there, and so do its events still queued
    /// (not yet got) on the old one. librdmacm waits until every event
    /// already reported for the id is acked: rdmasafe acks at copy time, so
    /// this never waits on copies the app still holds.
    ///
    /// A listening id is the exception: a CONNECT_REQUEST still queued for
    /// it is lost in the move (librdmacm's get on the new channel consumes
    /// it and reports nothing; the same with librdmacm alone, seen on
    /// rxe): migrate a listener only with no connect request pending.
    ///
    /// The kernel moves the queued events without waking the new channel's
    /// waiters (a thread asleep in poll() on its fd, an edge-triggered
    /// epoll). rdmasafe's own waits on `to` are woken here: its get calls,
    /// a [`super::Dispatcher`], `aio::AsyncEventChannel` (feature `tokio`) and the
    /// `mio` `Source`. A wait of the app's own on the raw fd is not: try a
    /// get after a migrate.
    pub fn migrate(&mut self, to: &EventChannel) -> Result<()> {
        // SAFETY: live id and live target channel.
        cvt("rdma_migrate_id", unsafe { sys::rdma_migrate_id(self.raw(), to.inner.raw()) })?;
        self._channel = to.inner.clone();
        to.inner.signal_moved_in();
        Ok(())
    }

    /// `rdma_disconnect`.
    pub fn disconnect(&self) -> Result<()> {
        // SAFETY: live id.
        cvt("rdma_disconnect", unsafe { sys::rdma_disconnect(self.raw()) })
    }

    fn qp_ptr(&self) -> Result<*mut sys::ibv_qp> {
        self.qp.as_ref().ok_or(Error::new("ibv_post", libc::EINVAL))?;
        // SAFETY: the QP exists while self.qp is Some.
        Ok(unsafe { (*self.raw.as_ptr()).qp })
    }

    fn keep_mr(&self, mr: &Mr) -> Result<*mut sys::ibv_qp> {
        let parts = self.qp.as_ref().ok_or(Error::new("ibv_post", libc::EINVAL))?;
        let mut mrs = parts.mrs.lock().unwrap_or_else(|e| e.into_inner());
        let keep = mr.keep();
        if !mrs.iter().any(|m| Arc::ptr_eq(m, &keep)) {
            mrs.push(keep);
        }
        // SAFETY: the QP exists while self.qp is Some.
        Ok(unsafe { (*self.raw.as_ptr()).qp })
    }

    /// Posts one receive of `len` bytes at `offset` in `mr`. The MR is kept
    /// alive until the QP is destroyed.
    pub fn post_recv(&self, mr: &Mr, offset: usize, len: u32, wr_id: u64) -> Result<()> {
        let qp = self.keep_mr(mr)?;
        let mut sge = mr.sge(offset, len).ok_or(Error::new("ibv_post_recv", libc::EINVAL))?;
        // SAFETY: ibv_recv_wr is plain data; zero is valid.
        let mut wr: sys::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad = null_mut();
        // SAFETY: live QP; wr and sge valid for the call; the MR memory stays
        // registered and allocated while the QP exists (kept above).
        let r = unsafe { sys::ibv_post_recv(qp, &mut wr, &mut bad) };
        if r == 0 {
            Ok(())
        } else {
            Err(Error::new("ibv_post_recv", r))
        }
    }

    /// Posts one signaled SEND of `len` bytes at `offset` in `mr`.
    pub fn post_send(&self, mr: &Mr, offset: usize, len: u32, wr_id: u64) -> Result<()> {
        self.post_send_with(mr, offset, len, wr_id, SendOptions::default())
    }

    /// Posts one SEND of `len` bytes at `offset` in `mr`, with `opts`.
    pub fn post_send_with(&self, mr: &Mr, offset: usize, len: u32, wr_id: u64, opts: SendOptions) -> Result<()> {
        let qp = self.keep_mr(mr)?;
        let sge = mr.sge(offset, len).ok_or(Error::new("ibv_post_send", libc::EINVAL))?;
        // SAFETY: live QP; the MR stays registered while the QP exists.
        unsafe {
            post_one(qp, Post { opcode: sys::ibv_wr_opcode::IBV_WR_SEND, sge: Some(sge), wr_id, opts, ..Post::NONE })
        }
    }

    /// Posts one SEND with immediate data `imm` (the peer's receive
    /// completion carries it: [`crate::verbs::Wc::imm_data`]).
    pub fn post_send_imm(
        &self,
        mr: &Mr,
        offset: usize,
        len: u32,
        imm: u32,
        wr_id: u64,
        opts: SendOptions,
    ) -> Result<()> {
        let qp = self.keep_mr(mr)?;
        let sge = mr.sge(offset, len).ok_or(Error::new("ibv_post_send", libc::EINVAL))?;
        let opcode = sys::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
        // SAFETY: as above.
        unsafe { post_one(qp, Post { opcode, sge: Some(sge), wr_id, opts, imm: Some(imm), ..Post::NONE }) }
    }

    /// Posts one SEND of `data` inline: the device copies the bytes at post
    /// time, so no MR is needed and `data` may be reused at once. `data`
    /// must fit the QP's `max_inline_data` ([`QpCaps`]) or the post fails
    /// (EINVAL or ENOMEM, as the driver says).
    pub fn post_send_inline(&self, data: &[u8], wr_id: u64, opts: SendOptions) -> Result<()> {
        let qp = self.qp_ptr()?;
        let len = u32::try_from(data.len()).map_err(|_| Error::new("ibv_post_send(inline)", libc::EINVAL))?;
        let sge = sys::ibv_sge { addr: data.as_ptr() as u64, length: len, lkey: 0 };
        let opts = SendOptions { inline: true, ..opts };
        // SAFETY: live QP; with IBV_SEND_INLINE the bytes are copied during
        // the call, while `data` is borrowed.
        unsafe {
            post_one(qp, Post { opcode: sys::ibv_wr_opcode::IBV_WR_SEND, sge: Some(sge), wr_id, opts, ..Post::NONE })
        }
    }

    /// Posts one RDMA WRITE of `len` bytes at `offset` in `mr` to `remote`
    /// (at its start; use [`RemoteMr::slice`] for an offset). The peer's
    /// application sees nothing unless `imm` is set: then the write consumes
    /// one of the peer's posted receives, whose completion carries `imm`.
    /// EINVAL if the range is outside `mr` or larger than `remote`.
    #[allow(clippy::too_many_arguments)]
    pub fn post_write(
        &self,
        mr: &Mr,
        offset: usize,
        len: u32,
        remote: RemoteMr,
        imm: Option<u32>,
        wr_id: u64,
        opts: SendOptions,
    ) -> Result<()> {
        let qp = self.keep_mr(mr)?;
        let sge = mr.sge(offset, len).ok_or(Error::new("ibv_post_send(RDMA WRITE)", libc::EINVAL))?;
        if len > remote.len {
            return Err(Error::new("ibv_post_send(RDMA WRITE): larger than the remote range", libc::EINVAL));
        }
        let opcode = match imm {
            Some(_) => sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            None => sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        };
        // SAFETY: as for post_send_with; the remote side is checked by the
        // peer's device (rkey and range).
        unsafe { post_one(qp, Post { opcode, sge: Some(sge), wr_id, opts, imm, remote: Some(remote) }) }
    }

    /// Posts one RDMA READ of `len` bytes from `remote` into `mr` at
    /// `offset`. The bytes are in `mr` once the completion (signaled:
    /// always ask for one, or post a signaled request after it) is seen.
    /// EINVAL if the range is outside `mr` or larger than `remote`.
    pub fn post_read(
        &self,
        mr: &Mr,
        offset: usize,
        len: u32,
        remote: RemoteMr,
        wr_id: u64,
        opts: SendOptions,
    ) -> Result<()> {
        let qp = self.keep_mr(mr)?;
        let sge = mr.sge(offset, len).ok_or(Error::new("ibv_post_send(RDMA READ)", libc::EINVAL))?;
        if len > remote.len {
            return Err(Error::new("ibv_post_send(RDMA READ): larger than the remote range", libc::EINVAL));
        }
        let opts = SendOptions { inline: false, ..opts };
        let opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_READ;
        // SAFETY: as for post_write; the device writes into `mr`, which the
        // QP keeps registered.
        unsafe { post_one(qp, Post { opcode, sge: Some(sge), wr_id, opts, remote: Some(remote), ..Post::NONE }) }
    }

    /// `rdma_accept`. For the new id of a [`ConnectRequest`], use
    /// [`ConnectRequest::accept`] instead.
    fn accept_raw(&self, params: &ConnectParams<'_>) -> Result<()> {
        let mut p = params.to_raw("rdma_accept")?;
        // SAFETY: live id; p valid for the call.
        cvt("rdma_accept", unsafe { sys::rdma_accept(self.raw(), &mut p) })
    }

    fn reject_raw(&self, data: &[u8]) -> Result<()> {
        let len = u8::try_from(data.len()).map_err(|_| Error::new("rdma_reject", libc::EINVAL))?;
        let ptr = if data.is_empty() { std::ptr::null() } else { data.as_ptr().cast() };
        // SAFETY: live id; data valid for the call.
        cvt("rdma_reject", unsafe { sys::rdma_reject(self.raw(), ptr, len) })
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // The QP first, then what it used (PD, CQs, MRs: their context is
        // kept open by their own references, and they go before the id, as
        // a removed device's context may close with the last id), then the
        // id. Events of rdmasafe channels were acked when copied, so
        // rdma_destroy_id waits on nothing of rdmasafe's.
        if let Some(parts) = &self.qp {
            // No loop may touch the QP from here on (waits for a probe or
            // drain marker being posted right now).
            parts.life.end();
            // SAFETY: the QP was created on this live id.
            unsafe { sys::rdma_destroy_qp(self.raw()) };
        }
        drop(self.qp.take());
        // SAFETY: the id is live and ours.
        unsafe { sys::rdma_destroy_id(self.raw()) };
        // The channel keep-alive drops after this.
    }
}

impl std::fmt::Debug for CmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CmId(token {}, {:p})", self.token.get(), self.raw)
    }
}

/// The new id of an incoming CONNECT_REQUEST, taken from its event with
/// [`super::CmEvent::take_request`]. Create a QP on it ([`ConnectRequest::id_mut`]),
/// then [`accept`](ConnectRequest::accept) or [`reject`](ConnectRequest::reject).
/// Dropped without either, the request is rejected and the id destroyed.
/// (A TCP-port-space client then sees REJECTED; a UDP one, UNREACHABLE:
/// the kernel reports a rejected UD request so.)
pub struct ConnectRequest {
    id: Option<CmId>,
}

impl ConnectRequest {
    pub(crate) fn new(id: CmId) -> ConnectRequest {
        ConnectRequest { id: Some(id) }
    }

    /// The new id, e.g. to create its QP before accepting.
    pub fn id_mut(&mut self) -> &mut CmId {
        self.id.as_mut().expect("ConnectRequest holds its id until consumed")
    }

    /// The new id's token (its events carry it).
    pub fn token(&self) -> IdToken {
        self.id.as_ref().expect("ConnectRequest holds its id until consumed").token()
    }

    /// Accepts (`rdma_accept`) and hands over the connected id. On failure
    /// the id is destroyed (after a reject) and the error returned.
    pub fn accept(mut self, params: &ConnectParams<'_>) -> Result<CmId> {
        let id = self.id.take().expect("ConnectRequest holds its id until consumed");
        match id.accept_raw(params) {
            Ok(()) => Ok(id),
            Err(e) => {
                let _ = id.reject_raw(&[]);
                Err(e)
            }
        }
    }

    /// Rejects with private data (`rdma_reject`) and destroys the id. (A
    /// UDP-port-space client sees UNREACHABLE, not REJECTED.)
    pub fn reject(mut self, private_data: &[u8]) -> Result<()> {
        let id = self.id.take().expect("ConnectRequest holds its id until consumed");
        id.reject_raw(private_data)
    }
}

impl Drop for ConnectRequest {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let _ = id.reject_raw(&[]);
        }
    }
}

impl std::fmt::Debug for ConnectRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ConnectRequest({:?})", self.id)
    }
}
