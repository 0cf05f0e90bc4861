//! An async echo server and its clients on tokio, in one process: each
//! client connects with private data ("hi" and its index), gets the
//! server's private data back ("ok" and the index), sends one message,
//! reads the echo, and the connection is torn down cleanly (the server
//! disconnects once its echo completed and its id is ESTABLISHED; both
//! sides drain their QP and remove their CQ without blocking the
//! runtime).
//!
//! Every connection has a CQ of its own; the server's CQs share one
//! completion channel and one [`AsyncCqLoop`], the clients' another, and
//! CQs join and leave those loops from the CM tasks while they run. Every
//! completion a handler sees is counted, so the run checks that each
//! arrived exactly once.
//!
//! Run it in the Soft-RoCE guest (the cargo runner starts one for `rxe_*`
//! binaries):
//!
//! ```text
//! cargo run --features tokio --example rxe_async_echo -- [CLIENTS] [current|multi]
//! ```
//!
//! The address is the guest's (RDMASAFE_TEST_ADDR, 10.77.0.1), or the
//! host's device with RDMASAFE_DEVICE / RDMASAFE_ADDR set.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdmasafe_core::aio::{self, AsyncCqLoop, AsyncEventChannel};
use rdmasafe_core::cm::{CmEvent, CmId, ConnectParams, EventChannel, EventType, PortSpace, QpCaps};
use rdmasafe_core::cq::{CqLoop, LoopControl, LoopOptions, LoopStats};
use rdmasafe_core::verbs::{CompChannel, Cq, DeviceContext, Mr, Pd, Wc};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Any error of the example.
pub type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// Bytes per message.
pub const MSG: usize = 64;
/// wr_id of each side's one receive and one send.
pub const RECV_WR: u64 = 1;
/// See [`RECV_WR`].
pub const SEND_WR: u64 = 2;
/// Bounds every wait (turns a hang into an error; generous for TCG).
pub const STEP: Duration = Duration::from_secs(60);

const CAPS: QpCaps = QpCaps { max_send_wr: 4, max_recv_wr: 4, max_sge: 1, max_inline_data: 0 };

/// Every completion a handler saw, by (side 'c' or 's', connection index,
/// wr_id), counted.
#[derive(Default)]
pub struct Tally(Mutex<HashMap<(char, u32, u64), u32>>);

impl Tally {
    fn note(&self, side: char, conn: u32, wcs: &[Wc]) {
        let mut m = self.0.lock().unwrap();
        for wc in wcs {
            *m.entry((side, conn, wc.wr_id())).or_default() += 1;
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> HashMap<(char, u32, u64), u32> {
        self.0.lock().unwrap().clone()
    }
}

/// What a run did.
pub struct Report {
    /// Completions seen by the handlers, by (side, connection, wr_id).
    pub completions: HashMap<(char, u32, u64), u32>,
    /// The server's and the clients' loop figures after their stop.
    pub server_loop: LoopStats,
    /// See `server_loop`.
    pub client_loop: LoopStats,
}

/// The client's private data.
pub fn hello(i: u32) -> [u8; 6] {
    let b = i.to_le_bytes();
    [b'h', b'i', b[0], b[1], b[2], b[3]]
}

/// The server's private data.
pub fn welcome(i: u32) -> [u8; 6] {
    let b = i.to_le_bytes();
    [b'o', b'k', b[0], b[1], b[2], b[3]]
}

/// Client `i`'s message.
pub fn message(i: u32) -> [u8; MSG] {
    std::array::from_fn(|k| (k as u8).wrapping_mul(31) ^ (i as u8) ^ 0x5a)
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> Result<T, BoxErr> {
    tokio::time::timeout(STEP, f).await.map_err(|_| format!("{what}: no progress within {STEP:?}").into())
}

async fn expect(ch: &AsyncEventChannel, want: EventType) -> Result<CmEvent, BoxErr> {
    let ev = within(&format!("waiting for {want}"), ch.next()).await??;
    if ev.event_type() != want {
        return Err(format!("expected {want}, got {} (status {})", ev.event_type(), ev.status()).into());
    }
    Ok(ev)
}

/// Runs the server and `n` clients on the current runtime (it must have
/// its I/O and time drivers: `enable_all`), on `addr`.
pub async fn echo(addr: IpAddr, n: usize) -> Result<Report, BoxErr> {
    let tally = Arc::new(Tally::default());
    let sch = AsyncEventChannel::new(EventChannel::new()?)?;
    let listener = sch.channel().create_id(PortSpace::Tcp)?;
    listener.bind_addr((addr, 0).into())?;
    listener.listen(n as i32)?;
    let port = listener.local_port();
    let ctx = listener.device_context()?;

    // One completion channel and one loop per side, running as tasks.
    let schan = CompChannel::new(&ctx)?;
    let cchan = CompChannel::new(&ctx)?;
    let sloop = AsyncCqLoop::new(CqLoop::new(&schan, LoopOptions::default())?)?.spawn();
    let cloop = AsyncCqLoop::new(CqLoop::new(&cchan, LoopOptions::default())?)?.spawn();

    // The server and the clients as tasks; the first failure ends the run.
    let mut tasks = tokio::task::JoinSet::new();
    let server = serve(sch, listener, ctx, schan, sloop.control(), tally.clone(), n);
    tasks.spawn(async move { server.await.map_err(|e| format!("server: {e}")) });
    for i in 0..n as u32 {
        let (ctl, chan, tally) = (cloop.control(), cchan.clone(), tally.clone());
        tasks.spawn(
            async move { client(addr, port, i, chan, ctl, tally).await.map_err(|e| format!("client {i}: {e}")) },
        );
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    // Stopped without blocking the runtime; every ack flushed.
    let server_loop = sloop.stop().await?.get_ref().stats();
    let client_loop = cloop.stop().await?.get_ref().stats();
    Ok(Report { completions: tally.counts(), server_loop, client_loop })
}

/// One server connection.
struct Conn {
    index: u32,
    id: CmId,
    mr: Mr,
    cq: Cq,
    /// ESTABLISHED came (the client's RTU was processed).
    established: bool,
    /// The echo's send completed.
    echoed: bool,
}

impl Conn {
    /// The server ends the connection once its echo is out *and* its id
    /// is ESTABLISHED: the data path can outrun the CM (the client sends
    /// right after its RTU, and the echo can complete before the server's
    /// CM has processed that RTU). A disconnect before ESTABLISHED only
    /// moves the QP to the error state: the kernel skips the DREQ, and the
    /// client would never see DISCONNECTED.
    fn disconnect_when_done(&self) -> Result<(), BoxErr> {
        if self.established && self.echoed {
            self.id.disconnect()?;
        }
        Ok(())
    }
}

async fn serve(
    sch: AsyncEventChannel,
    listener: CmId,
    ctx: DeviceContext,
    schan: CompChannel,
    ctl: LoopControl,
    tally: Arc<Tally>,
    n: usize,
) -> Result<(), BoxErr> {
    let pd = Pd::new(&ctx)?;
    // The handlers pass completions to this task, which owns the ids.
    let (tx, mut rx) = unbounded_channel::<(u64, Wc)>();
    let mut conns: HashMap<u64, Conn> = HashMap::new();
    let mut teardowns = Vec::new();
    while teardowns.len() < n {
        tokio::select! {
            ev = sch.next() => {
                let mut ev = ev?;
                match ev.event_type() {
                    EventType::CONNECT_REQUEST => {
                        let pdata = ev.private_data();
                        if pdata.len() < 6 || &pdata[..2] != b"hi" {
                            return Err(format!("bad private data {:?}", &pdata[..pdata.len().min(6)]).into());
                        }
                        let index = u32::from_le_bytes(pdata[2..6].try_into().unwrap());
                        let mut req = ev.take_request().ok_or("a connect request without its id")?;
                        let key = req.token().get();
                        let cq = Cq::new(&ctx, 8, Some(&schan))?;
                        req.id_mut().create_qp(&pd, &cq, &cq, CAPS, false)?;
                        let mr = Mr::new(&pd, 2 * MSG)?;
                        req.id_mut().post_recv(&mr, 0, MSG as u32, RECV_WR)?;
                        // A CQ joins the running loop, from this task.
                        let (tx, tally) = (tx.clone(), tally.clone());
                        ctl.add_cq(&cq, ctl.default_cq_options(), move |wcs, _| {
                            tally.note('s', index, wcs);
                            for wc in wcs {
                                let _ = tx.send((key, wc.clone()));
                            }
                        })?;
                        let id = req.accept(&ConnectParams { private_data: &welcome(index), ..Default::default() })?;
                        conns.insert(key, Conn { index, id, mr, cq, established: false, echoed: false });
                    }
                    EventType::ESTABLISHED => {
                        let key = ev.token().ok_or("ESTABLISHED without a token")?.get();
                        let conn = conns.get_mut(&key).ok_or("ESTABLISHED of an unknown connection")?;
                        conn.established = true;
                        conn.disconnect_when_done()?;
                    }
                    EventType::DISCONNECTED => {
                        let key = ev.token().ok_or("DISCONNECTED without a token")?.get();
                        let conn = conns.remove(&key).ok_or("DISCONNECTED of an unknown connection")?;
                        // Drain (never blocking), then take the CQ out of
                        // the loop, then free the connection.
                        let drained = aio::drain_id(&ctl, &conn.id, STEP)?;
                        let ctl = ctl.clone();
                        teardowns.push(tokio::spawn(async move {
                            within("server drain", drained).await??;
                            within("server remove_cq", aio::remove_cq(&ctl, &conn.cq)?).await??;
                            drop(conn);
                            Ok::<(), BoxErr>(())
                        }));
                    }
                    // Late events of ids on their way out.
                    EventType::TIMEWAIT_EXIT => {}
                    other => return Err(format!("server: unexpected {other} (status {})", ev.status()).into()),
                }
            }
            Some((key, wc)) = rx.recv() => {
                let conn = conns.get_mut(&key).ok_or("a completion of an unknown connection")?;
                if !wc.is_success() {
                    return Err(format!("server {}: wr {} {}", conn.index, wc.wr_id(), wc.status()).into());
                }
                match wc.wr_id() {
                    RECV_WR => {
                        // Echo: copy the message to the send half, send it.
                        let mut buf = [0u8; MSG];
                        conn.mr.read(0, &mut buf)?;
                        conn.mr.write(MSG, &buf)?;
                        conn.id.post_send(&conn.mr, MSG, MSG as u32, SEND_WR)?;
                    }
                    // The echo is out: the server ends the connection.
                    SEND_WR => {
                        conn.echoed = true;
                        conn.disconnect_when_done()?;
                    }
                    other => return Err(format!("server: completion of wr {other}").into()),
                }
            }
        }
    }
    for t in teardowns {
        t.await??;
    }
    drop(listener);
    Ok(())
}

async fn client(
    addr: IpAddr,
    port: u16,
    i: u32,
    chan: CompChannel,
    ctl: LoopControl,
    tally: Arc<Tally>,
) -> Result<(), BoxErr> {
    let ch = AsyncEventChannel::new(EventChannel::new()?)?;
    let mut id = ch.channel().create_id(PortSpace::Tcp)?;
    id.resolve_addr(None, (addr, port).into(), Duration::from_secs(10))?;
    expect(&ch, EventType::ADDR_RESOLVED).await?;
    id.resolve_route(Duration::from_secs(10))?;
    expect(&ch, EventType::ROUTE_RESOLVED).await?;
    let ctx = id.device_context()?;
    let pd = Pd::new(&ctx)?;
    let cq = Cq::new(&ctx, 8, Some(&chan))?;
    id.create_qp(&pd, &cq, &cq, CAPS, false)?;
    let mut mr = Mr::new(&pd, 2 * MSG)?;
    id.post_recv(&mr, MSG, MSG as u32, RECV_WR)?;
    let (tx, mut rx) = unbounded_channel::<Wc>();
    let t2 = tally.clone();
    ctl.add_cq(&cq, ctl.default_cq_options(), move |wcs, _| {
        t2.note('c', i, wcs);
        for wc in wcs {
            let _ = tx.send(wc.clone());
        }
    })?;
    id.connect(&ConnectParams { private_data: &hello(i), ..Default::default() })?;
    let est = expect(&ch, EventType::ESTABLISHED).await?;
    if est.private_data().get(..6) != Some(&welcome(i)[..]) {
        return Err(format!("client {i}: the server's private data is {:?}", est.private_data().get(..6)).into());
    }
    drop(est);
    mr.write(0, &message(i))?;
    id.post_send(&mr, 0, MSG as u32, SEND_WR)?;
    let mut got = [false; 2];
    while got != [true, true] {
        let wc = next_wc(&mut rx).await?;
        if !wc.is_success() {
            return Err(format!("client {i}: wr {} {}", wc.wr_id(), wc.status()).into());
        }
        match wc.wr_id() {
            SEND_WR => got[0] = true,
            RECV_WR => {
                let mut echo = [0u8; MSG];
                mr.read(MSG, &mut echo)?;
                if wc.byte_len() as usize != MSG || echo != message(i) {
                    return Err(format!("client {i}: a wrong echo ({} bytes)", wc.byte_len()).into());
                }
                got[1] = true;
            }
            other => return Err(format!("client {i}: completion of wr {other}").into()),
        }
    }
    // The server disconnects; answer, then drain and leave the loop.
    if let Err(e) = expect(&ch, EventType::DISCONNECTED).await {
        // What the peer got to (diagnostics for a run that hangs here).
        let late = ch.channel().try_get().map(|o| o.map(|ev| ev.event_type()));
        let c = tally.counts();
        let srv = (c.get(&('s', i, RECV_WR)).copied(), c.get(&('s', i, SEND_WR)).copied());
        return Err(format!("{e} (a get now: {late:?}; server's recv, send completions seen: {srv:?})").into());
    }
    id.disconnect()?;
    within("client drain", aio::drain_id(&ctl, &id, STEP)?).await??;
    within("client remove_cq", aio::remove_cq(&ctl, &cq)?).await??;
    drop(id);
    Ok(())
}

async fn next_wc(rx: &mut UnboundedReceiver<Wc>) -> Result<Wc, BoxErr> {
    within("a completion", rx.recv()).await?.ok_or_else(|| "the CQ's handler is gone".into())
}

/// Checks a report: every completion of every connection exactly once,
/// nothing else delivered (a drain's markers never are), nothing left
/// unacked, every CQ out of its loop.
pub fn check(r: &Report, n: usize) -> Result<(), BoxErr> {
    for i in 0..n as u32 {
        for side in ['c', 's'] {
            for wr in [RECV_WR, SEND_WR] {
                let seen = r.completions.get(&(side, i, wr)).copied().unwrap_or(0);
                if seen != 1 {
                    return Err(format!("{side} {i} wr {wr}: seen {seen} times").into());
                }
            }
        }
    }
    if r.completions.len() != 4 * n {
        return Err(format!("{} kinds of completions, {} expected", r.completions.len(), 4 * n).into());
    }
    for (what, s) in [("server", &r.server_loop), ("client", &r.client_loop)] {
        if s.unacked_now != 0 || s.cqs != 0 || s.completions != 2 * n as u64 {
            return Err(format!(
                "{what} loop: {} unacked, {} CQs left, {} completions",
                s.unacked_now, s.cqs, s.completions
            )
            .into());
        }
    }
    Ok(())
}

#[allow(dead_code)]
fn main() -> Result<(), BoxErr> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(Ok(64), |a| a.parse())?;
    let multi = args.next().as_deref() != Some("current");
    let addr: IpAddr = std::env::var("RDMASAFE_TEST_ADDR")
        .or_else(|_| std::env::var("RDMASAFE_ADDR"))
        .unwrap_or_else(|_| "10.77.0.1".into())
        .parse()?;
    let rt = if multi {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?
    } else {
        tokio::runtime::Builder::new_current_thread().enable_all().build()?
    };
    let t0 = std::time::Instant::now();
    let report = rt.block_on(echo(addr, n))?;
    check(&report, n)?;
    let copies = rdmasafe_core::cm::counters();
    println!(
        "{n} clients on a {} runtime: {} completions, each exactly once; server loop {} wakeups / {} ack calls, \
         client loop {} wakeups / {} ack calls; {} CM events copied, {} copies outstanding; {:.2?}",
        if multi { "multi-thread" } else { "current-thread" },
        report.completions.values().sum::<u32>(),
        report.server_loop.wakeups,
        report.server_loop.ack_calls,
        report.client_loop.wakeups,
        report.client_loop.ack_calls,
        copies.copied,
        copies.outstanding,
        t0.elapsed()
    );
    if copies.outstanding != 0 {
        return Err("CM event copies outstanding at the end".into());
    }
    Ok(())
}
