//! The small safe data path on Soft-RoCE: the app's own memory registered
//! (handed over and given back, or managed by the app), RDMA WRITE (with and
//! without immediate data) and READ, SEND with immediate, inline sends from
//! a stack buffer, unsignalled sends, and the errors the device and the
//! library report for what must not work (a WRITE into a region that
//! forbids it, ranges too large, remote write without local write).

mod common;

use std::net::IpAddr;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use common::rc::{rc_pair_with, RcPair};
use rdmasafe_core::cm::{EventChannel, PortSpace, QpCaps, SendOptions};
use rdmasafe_core::verbs::{CompChannel, Cq, DeviceContext, Mr, MrAccess, RemoteMr, Wc, WcOpcode, WcStatus};

fn device(addr: IpAddr) -> (DeviceContext, EventChannel) {
    let ch = EventChannel::new().unwrap();
    let id = ch.create_id(PortSpace::Tcp).unwrap();
    id.bind_addr((addr, 0).into()).unwrap();
    (id.device_context().unwrap(), ch)
}

/// Polls until `n` completions came (60 s watchdog).
fn poll_n(cq: &Cq, n: usize) -> Vec<Wc> {
    let start = Instant::now();
    let mut got = Vec::new();
    let mut wcs: [Wc; 8] = std::array::from_fn(|_| Wc::zeroed());
    while got.len() < n {
        let k = cq.poll(&mut wcs).unwrap();
        got.extend(wcs[..k].iter().cloned());
        assert!(start.elapsed() < Duration::from_secs(60), "{} of {n} completions: {got:?}", got.len());
        if k == 0 {
            std::thread::yield_now();
        }
    }
    got
}

/// Nothing more arrives for a while (a negative check: it can only fail).
fn quiet(cq: &Cq) {
    std::thread::sleep(Duration::from_millis(100));
    let mut wcs: [Wc; 8] = std::array::from_fn(|_| Wc::zeroed());
    let k = cq.poll(&mut wcs).unwrap();
    assert_eq!(k, 0, "unexpected completions: {:?}", &wcs[..k]);
}

fn pair(addr: IpAddr, chan: &CompChannel) -> RcPair {
    let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, max_sge: 1, max_inline_data: 64 };
    rc_pair_with(addr, chan, false, caps, 32)
}

#[test]
fn rdma_write_read_imm_inline_unsignalled_on_app_memory() {
    let bed = common::bed();
    let _dog = common::watchdog("verbs data path", Duration::from_secs(180));
    let (ctx, _keep) = device(bed.addr);
    let chan = CompChannel::new(&ctx).unwrap();
    let p = pair(bed.addr, &chan);
    let (scq, ccq) = (&p.server_cq, &p.client_cq);

    // The server's target: the app's own heap buffer, handed to the MR.
    let mut target = {
        let s = p.server.lock().unwrap();
        Mr::from_box(&s.pd, vec![0u8; 4096].into_boxed_slice(), MrAccess::ALL).unwrap()
    };
    target.write(0, b"read me back").unwrap();
    let remote = RemoteMr::from_bytes(&target.remote().to_bytes()).expect("16 bytes");
    assert_eq!(remote, target.remote());
    assert_eq!(remote.len, 4096);

    // RDMA WRITE without immediate: the server's app sees no completion.
    let mut src = {
        let c = p.client.lock().unwrap();
        Mr::from_box(&c.pd, vec![0u8; 4096].into_boxed_slice(), MrAccess::LOCAL).unwrap()
    };
    src.write(0, b"written by RDMA WRITE").unwrap();
    {
        let c = p.client.lock().unwrap();
        c.id.post_write(&src, 0, 21, remote.slice(100, 21).unwrap(), None, 1, SendOptions::default()).unwrap();
    }
    let w = poll_n(ccq, 1);
    assert_eq!((w[0].wr_id(), w[0].status(), w[0].opcode()), (1, WcStatus::SUCCESS, WcOpcode::RDMA_WRITE));
    quiet(scq);
    let mut got = [0u8; 21];
    target.read(100, &mut got).unwrap();
    assert_eq!(&got, b"written by RDMA WRITE");

    // RDMA WRITE with immediate: consumes a posted receive, which carries it.
    p.recv(0, 64, 500);
    {
        let c = p.client.lock().unwrap();
        src.write(0, b"with imm").unwrap();
        c.id.post_write(&src, 0, 8, remote.slice(200, 8).unwrap(), Some(0xC0FFEE), 2, SendOptions::default()).unwrap();
    }
    assert_eq!(poll_n(ccq, 1)[0].status(), WcStatus::SUCCESS);
    let r = poll_n(scq, 1);
    assert_eq!((r[0].wr_id(), r[0].opcode(), r[0].imm_data()), (500, WcOpcode::RECV_RDMA_WITH_IMM, Some(0xC0FFEE)));
    let mut got = [0u8; 8];
    target.read(200, &mut got).unwrap();
    assert_eq!(&got, b"with imm");

    // RDMA READ of the server's bytes into the client's buffer.
    {
        let c = p.client.lock().unwrap();
        c.id.post_read(&src, 1000, 12, remote.slice(0, 12).unwrap(), 3, SendOptions::default()).unwrap();
    }
    let w = poll_n(ccq, 1);
    assert_eq!(
        (w[0].wr_id(), w[0].status(), w[0].opcode(), w[0].byte_len()),
        (3, WcStatus::SUCCESS, WcOpcode::RDMA_READ, 12)
    );
    let mut got = [0u8; 12];
    src.read(1000, &mut got).unwrap();
    assert_eq!(&got, b"read me back");

    // SEND with immediate, and an inline SEND from a stack buffer.
    p.recv(64, 64, 501);
    p.recv(128, 64, 502);
    {
        let c = p.client.lock().unwrap();
        src.write(0, b"imm send").unwrap();
        c.id.post_send_imm(&src, 0, 8, 7, 4, SendOptions::default()).unwrap();
        let stack = *b"inline, no MR";
        c.id.post_send_inline(&stack, 5, SendOptions::default()).unwrap();
    }
    let w = poll_n(ccq, 2);
    assert_eq!(
        w.iter().map(|w| (w.wr_id(), w.status())).collect::<Vec<_>>(),
        vec![(4, WcStatus::SUCCESS), (5, WcStatus::SUCCESS)]
    );
    let r = poll_n(scq, 2);
    assert_eq!((r[0].wr_id(), r[0].imm_data(), r[0].byte_len()), (501, Some(7), 8));
    assert_eq!((r[1].wr_id(), r[1].imm_data(), r[1].byte_len()), (502, None, 13));
    let mut got = [0u8; 13];
    p.read_server(128, &mut got);
    assert_eq!(&got, b"inline, no MR");

    // Unsignalled sends: 3 silent, 1 signalled; the peer receives 4, the
    // sender sees one completion.
    for i in 0..4 {
        p.recv(192 + 64 * i, 64, 600 + i as u64);
    }
    {
        let c = p.client.lock().unwrap();
        for i in 0..4u64 {
            let opts = SendOptions { signaled: i == 3, ..SendOptions::default() };
            c.id.post_send_with(&src, 0, 8, 10 + i, opts).unwrap();
        }
    }
    let w = poll_n(ccq, 1);
    assert_eq!(w[0].wr_id(), 13, "only the signalled send completes");
    quiet(ccq);
    let r = poll_n(scq, 4);
    assert_eq!(r.iter().map(|w| w.wr_id()).collect::<Vec<_>>(), vec![600, 601, 602, 603]);

    // Errors the library reports before posting.
    {
        let c = p.client.lock().unwrap();
        let too_big = c.id.post_write(&src, 0, 64, remote.slice(0, 32).unwrap(), None, 20, SendOptions::default());
        assert_eq!(too_big.unwrap_err().errno(), libc::EINVAL, "larger than the remote range");
        let outside = c.id.post_read(&src, 4090, 64, remote, 21, SendOptions::default());
        assert_eq!(outside.unwrap_err().errno(), libc::EINVAL, "outside the local MR");
    }
    assert!(remote.slice(4090, 64).is_none());
    let pd = p.server.lock().unwrap().pd.clone();
    let bad = MrAccess { local_write: false, remote_write: true, remote_read: false };
    assert_eq!(Mr::from_box(&pd, vec![0u8; 8].into_boxed_slice(), bad).map(|_| ()).unwrap_err().errno(), libc::EINVAL);
    assert_eq!(
        Mr::from_box(&pd, Vec::new().into_boxed_slice(), MrAccess::ALL).map(|_| ()).unwrap_err().errno(),
        libc::EINVAL
    );

    // The buffer handed over comes back only once no QP holds it.
    assert!(src.is_shared(), "the client's QP posted on it");
    let src = src.try_into_box().expect_err("a QP still holds it");
    drop(p); // the QPs go
    assert!(!src.is_shared());
    let back = src.try_into_box().expect("no QP holds it any more");
    assert_eq!(&back[1000..1012], b"read me back");
    let back_target = target.try_into_box().expect("never posted on");
    assert_eq!(&back_target[100..121], b"written by RDMA WRITE");
}

/// A peer's RDMA WRITE into a region registered without remote write fails
/// on the writer's side with a remote access error (the device enforces
/// it), and the QP goes to the error state: the next request is flushed.
/// The region is app-managed memory (an anonymous mapping).
#[test]
fn a_write_into_a_region_that_forbids_it_is_a_remote_access_error() {
    let bed = common::bed();
    let _dog = common::watchdog("remote access error", Duration::from_secs(120));
    let (ctx, _keep) = device(bed.addr);
    let chan = CompChannel::new(&ctx).unwrap();
    let p = pair(bed.addr, &chan);
    let len = 8192;
    // SAFETY: a fresh anonymous mapping, ours until munmap below.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED);
    let addr = NonNull::new(map.cast::<u8>()).unwrap();
    let pd = p.server.lock().unwrap().pd.clone();
    let read_only = MrAccess { local_write: true, remote_write: false, remote_read: true };
    // SAFETY: the mapping outlives the MR and the QPs (munmap after both
    // are dropped); no Rust reference into it exists.
    let mut mr = unsafe { Mr::register_raw(&pd, addr, len, read_only) }.unwrap();
    mr.write(0, b"app memory").unwrap();
    let mr = mr.try_into_box().expect_err("app-managed memory is never handed out as a Box");
    let remote = mr.remote();
    let src = {
        let c = p.client.lock().unwrap();
        Mr::new(&c.pd, 64).unwrap()
    };
    // READ is allowed, WRITE is not.
    {
        let c = p.client.lock().unwrap();
        c.id.post_read(&src, 0, 10, remote, 1, SendOptions::default()).unwrap();
    }
    let w = poll_n(&p.client_cq, 1);
    assert_eq!(w[0].status(), WcStatus::SUCCESS);
    let mut got = [0u8; 10];
    src.read(0, &mut got).unwrap();
    assert_eq!(&got, b"app memory");
    {
        let c = p.client.lock().unwrap();
        c.id.post_write(&src, 0, 8, remote, None, 2, SendOptions::default()).unwrap();
        c.id.post_send_with(&src, 0, 8, 3, SendOptions::default()).unwrap();
    }
    let w = poll_n(&p.client_cq, 2);
    assert_eq!((w[0].wr_id(), w[0].status()), (2, WcStatus::REM_ACCESS_ERR), "{:?}", w[0]);
    assert!(!w[0].status().as_str().is_empty());
    assert_eq!((w[1].wr_id(), w[1].status()), (3, WcStatus::WR_FLUSH_ERR));
    drop(mr);
    drop(p);
    // SAFETY: the MR and the QPs are gone; nothing uses the mapping.
    assert_eq!(unsafe { libc::munmap(map, len) }, 0);
}

/// `CompChannel::get_event` on an empty channel says "nothing now" as the
/// rest of the API does: EAGAIN for `Wait::None` (it said ETIMEDOUT, which
/// `is_would_block` does not match), ETIMEDOUT for a wait that ran out.
#[test]
fn an_empty_comp_channel_is_would_block_without_a_wait_and_a_timeout_with_one() {
    let bed = common::bed();
    let _dog = common::watchdog("empty comp channel", Duration::from_secs(60));
    let (ctx, _ch) = device(bed.addr);
    let chan = CompChannel::new(&ctx).unwrap();
    let cq = Cq::new(&ctx, 4, Some(&chan)).unwrap();
    cq.req_notify(false).unwrap();
    let e = chan.get_event(&[&cq], rdmasafe_core::Wait::None).map(|_| ()).unwrap_err();
    assert!(e.is_would_block(), "Wait::None on an empty channel: {e}");
    let e = chan.get_event(&[&cq], rdmasafe_core::Wait::For(Duration::from_millis(20))).map(|_| ()).unwrap_err();
    assert!(e.is_timeout(), "a 20 ms wait on an empty channel: {e}");
}
