//! The C functions called as C calls them, against our target on a reactor of this process: null and bad
//! arguments, a write and a read with a callback, a reap, a callback that submits again, the completion fd,
//! the ownership rules (a buffer in flight, a controller with a queue pair open), TLS with and without the
//! key.

use std::ffi::{c_int, c_void, CStr, CString};
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

use nvpoll_target::TargetTls;
use nvpoll_tcp::tls::ConfiguredKey;
use nvpoll_testkit::target::{TestTarget, HOSTNQN, NQN};

use super::*;
use crate::NvpollError;

/// The public test vector the scripts use too.
const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";

fn last() -> String {
    // SAFETY: a valid C string, this thread's.
    unsafe { CStr::from_ptr(nvpoll_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn trid(t: &TestTarget) -> CString {
    CString::new(format!(
        "trtype:tcp traddr:127.0.0.1 trsvcid:{} subnqn:{NQN}",
        t.addr.port()
    ))
    .unwrap()
}

fn pool() -> *mut NvpollPool {
    let mut p = null_mut();
    // SAFETY: a valid out pointer.
    let r = unsafe { nvpoll_pool_create(64, 1 << 16, 4, &mut p) };
    assert_eq!(r, 0, "{}", last());
    p
}

fn open(
    t: &TestTarget,
    pool: *mut NvpollPool,
    psk: Option<&CStr>,
) -> Result<*mut NvpollCtrl, c_int> {
    let host = CString::new(HOSTNQN).unwrap();
    let opts = NvpollCtrlOpts {
        hostnqn: host.as_ptr(),
        psk: psk.map_or(null(), CStr::as_ptr),
        psk_identity: null(),
        psk_identity_version: 0,
    };
    let mut c = null_mut();
    // SAFETY: valid strings, options and out pointer; a live pool.
    match unsafe { nvpoll_ctrl_open(trid(t).as_ptr(), &opts, pool, &mut c) } {
        0 => Ok(c),
        e => Err(e),
    }
}

fn buf(pool: *mut NvpollPool, len: usize) -> *mut NvpollBuf {
    let mut b = null_mut();
    // SAFETY: a live pool, a valid out pointer.
    let r = unsafe { nvpoll_buf_alloc(pool, len, &mut b) };
    assert_eq!(r, 0, "{}", last());
    b
}

/// What a test's callbacks record: statuses in order, and (for the resubmitting one) what it saw.
#[derive(Default)]
struct Log {
    statuses: Vec<c_int>,
    /// With `qp` and `read_buf` set, the callback submits a read of LBA 0 into `read_buf` (once).
    qp: Option<*mut NvpollQpair>,
    read_buf: Option<*mut NvpollBuf>,
    /// What process and free on its own queue pair answered inside the callback.
    nested: Vec<c_int>,
}

unsafe extern "C" fn record_cb(arg: *mut c_void, status: c_int) {
    // SAFETY: every test passes a live `Log` as arg.
    let log = unsafe { &mut *arg.cast::<Log>() };
    log.statuses.push(status);
    if let (Some(qp), Some(b)) = (log.qp, log.read_buf.take()) {
        // SAFETY: the queue pair is live (we are inside its callback), the buffer too.
        unsafe {
            log.nested.push(nvpoll_qpair_process_completions(qp, 0));
            log.nested.push(nvpoll_qpair_free(qp));
            log.nested
                .push(nvpoll_submit_read(qp, 1, 0, 8, b, Some(record_cb), arg));
            log.nested.push(nvpoll_qpair_flush(qp));
        }
    }
}

/// Waits on the completion fd (bounded) and processes until `done` or the deadline.
fn drive(qp: *mut NvpollQpair, mut done: impl FnMut() -> bool) {
    // SAFETY: a live queue pair.
    let fd = unsafe { nvpoll_qpair_completion_fd(qp) };
    assert!(fd >= 0, "{}", last());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "no completion within 10 s");
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, 100) };
        assert!(r >= 0);
        // SAFETY: a live queue pair, outside its callbacks.
        let n = unsafe { nvpoll_qpair_process_completions(qp, 0) };
        assert!(n >= 0, "{}", last());
    }
}

#[test]
fn null_and_bad_arguments_get_codes() {
    let e = NvpollError::NvpollErrInvalidArgument as c_int;
    // SAFETY: every pointer is null or valid; the functions must refuse the nulls.
    unsafe {
        assert_eq!(nvpoll_pool_create(1, 0, 0, null_mut()), e);
        assert_eq!(nvpoll_pool_free(null_mut()), e);
        assert_eq!(nvpoll_buf_free(null_mut()), e);
        assert!(nvpoll_buf_data(null_mut()).is_null());
        assert_eq!(nvpoll_buf_len(null()), 0);
        assert_eq!(nvpoll_ctrl_close(null_mut()), e);
        assert_eq!(nvpoll_ctrl_poll_admin(null_mut()), e);
        assert_eq!(nvpoll_ctrl_namespace_count(null_mut()), e);
        assert_eq!(nvpoll_qpair_free(null_mut()), e);
        assert_eq!(nvpoll_qpair_flush(null_mut()), e);
        assert_eq!(nvpoll_qpair_process_completions(null_mut(), 0), e);
        assert_eq!(nvpoll_qpair_reap(null_mut(), null_mut(), 0), e);
        assert_eq!(nvpoll_qpair_completion_fd(null_mut()), e);
        assert_eq!(nvpoll_submit_flush(null_mut(), 1, None, null_mut()), e);
        assert_eq!(last(), "invalid argument: qp is NULL");
        assert_eq!(
            nvpoll_last_error_retry(),
            NvpollRetry::NvpollRetryNever as c_int
        );
        assert_eq!(
            nvpoll_last_error_fault(),
            NvpollFault::NvpollFaultCaller as c_int
        );

        let mut p = null_mut();
        // A large class that is not a power of two, and a pool with no buffers.
        assert_eq!(nvpoll_pool_create(1, 5000, 1, &mut p), e);
        assert!(last().contains("power of two"), "{}", last());
        assert_eq!(nvpoll_pool_create(0, 0, 0, &mut p), e);
        assert!(p.is_null());
        let pool = pool();
        let mut b = null_mut();
        assert_eq!(nvpoll_buf_alloc(pool, 0, &mut b), e);
        assert_eq!(nvpoll_buf_alloc(pool, 1 << 20, &mut b), e);
        assert_eq!(nvpoll_buf_alloc(pool, 4096, null_mut()), e);

        let mut c = null_mut();
        assert_eq!(nvpoll_ctrl_open(null(), null(), pool, &mut c), e);
        let bad = CString::new("trtype:tcp traddr:localhost subnqn:x").unwrap();
        assert_eq!(nvpoll_ctrl_open(bad.as_ptr(), null(), pool, &mut c), e);
        assert!(last().contains("traddr"), "{}", last());
        // A PSK that does not parse, and an identity version that does not exist, fail before connecting.
        let good =
            CString::new("trtype:tcp traddr:127.0.0.1 trsvcid:9 subnqn:x hostnqn:h").unwrap();
        let junk = CString::new("NVMeTLSkey-1:01:notbase64:").unwrap();
        let mut opts = NvpollCtrlOpts {
            hostnqn: null(),
            psk: junk.as_ptr(),
            psk_identity: null(),
            psk_identity_version: 0,
        };
        assert_eq!(nvpoll_ctrl_open(good.as_ptr(), &opts, pool, &mut c), e);
        assert!(last().contains("PSK"), "{}", last());
        opts.psk_identity_version = 2;
        assert_eq!(nvpoll_ctrl_open(good.as_ptr(), &opts, pool, &mut c), e);
        let pcie = CString::new("trtype:pcie traddr:0000:00:04.0").unwrap();
        opts.psk_identity_version = 0;
        assert_eq!(nvpoll_ctrl_open(pcie.as_ptr(), &opts, pool, &mut c), e);
        assert!(c.is_null());
        assert_eq!(nvpoll_pool_free(pool), 0);

        assert_eq!(
            CStr::from_ptr(nvpoll_strerror(NvpollError::NvpollErrQueueFull as c_int)),
            c"queue full"
        );
        assert_eq!(
            CStr::from_ptr(nvpoll_strerror(-1000)),
            c"not an nvpoll error code"
        );
    }
}

#[test]
fn nothing_listening_is_a_connection_error() {
    let pool = pool();
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    let t = CString::new(format!(
        "trtype:tcp traddr:127.0.0.1 trsvcid:{port} subnqn:{NQN} hostnqn:{HOSTNQN}"
    ))
    .unwrap();
    let mut c = null_mut();
    // SAFETY: valid arguments.
    let r = unsafe { nvpoll_ctrl_open(t.as_ptr(), null(), pool, &mut c) };
    assert!(r < 0 && c.is_null(), "{r}");
    assert!(!last().is_empty());
    // SAFETY: a live pool.
    assert_eq!(unsafe { nvpoll_pool_free(pool) }, 0);
}

#[test]
fn write_then_read_back_with_a_callback_a_reap_and_the_completion_fd() {
    let t = TestTarget::start(|c| c);
    let pool = pool();
    let ctrl = open(&t, pool, None).unwrap_or_else(|e| panic!("{e}: {}", last()));
    // SAFETY: live handles and valid out pointers throughout; buffers are touched only while the caller's.
    unsafe {
        assert_eq!(nvpoll_ctrl_namespace_count(ctrl), 2);
        let mut ns = NvpollNsInfo::default();
        assert_eq!(nvpoll_ctrl_namespace_info(ctrl, 0, &mut ns), 0);
        assert_eq!(
            ns,
            NvpollNsInfo {
                nsid: 1,
                block_size: 512,
                blocks: (64 << 20) / 512
            }
        );
        assert_eq!(
            nvpoll_ctrl_namespace_info(ctrl, 2, &mut ns),
            NvpollError::NvpollErrInvalidArgument as c_int
        );
        let mut mt = 0;
        assert_eq!(nvpoll_ctrl_max_transfer(ctrl, &mut mt), 0);
        assert!(mt >= 4096, "{mt}");
        assert_eq!(nvpoll_ctrl_poll_admin(ctrl), 0);

        let mut qp = null_mut();
        assert_eq!(nvpoll_qpair_create(ctrl, 8, &mut qp), 0, "{}", last());
        // The controller does not close under an open queue pair.
        assert_eq!(nvpoll_ctrl_close(ctrl), NvpollError::NvpollErrBusy as c_int);

        let w = buf(pool, 4096);
        let r = buf(pool, 4096);
        assert_eq!(nvpoll_buf_len(w), 4096);
        let data = std::slice::from_raw_parts_mut(nvpoll_buf_data(w).cast::<u8>(), 4096);
        for (i, b) in data.iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        let expect = data.to_vec();

        // A write whose callback submits the read (a callback may submit on its own queue pair, and may not
        // process or free it).
        let mut log = Log {
            qp: Some(qp),
            read_buf: Some(r),
            ..Log::default()
        };
        let arg = (&raw mut log).cast::<c_void>();
        assert_eq!(
            nvpoll_submit_write(qp, 1, 0, 8, w, Some(record_cb), arg),
            0,
            "{}",
            last()
        );
        // In flight: the queue pair's.
        assert!(nvpoll_buf_data(w).is_null());
        assert_eq!(nvpoll_buf_free(w), NvpollError::NvpollErrBusy as c_int);
        assert_eq!(
            nvpoll_submit_write(qp, 1, 0, 8, w, None, null_mut()),
            NvpollError::NvpollErrBusy as c_int
        );
        assert_eq!(nvpoll_qpair_outstanding(qp), 1);
        assert_eq!(nvpoll_qpair_flush(qp), 0);
        drive(qp, || log.statuses.len() == 2);
        assert_eq!(log.statuses, [0, 0], "{}", last());
        let busy = NvpollError::NvpollErrBusy as c_int;
        assert_eq!(log.nested, [busy, busy, 0, 0]);
        let got = std::slice::from_raw_parts(nvpoll_buf_data(r).cast::<u8>(), 4096);
        assert_eq!(got, &expect[..]);
        assert!(!nvpoll_buf_data(w).is_null());

        // The same read again, reaped instead of called back; with a zero-filled buffer first.
        std::ptr::write_bytes(nvpoll_buf_data(r).cast::<u8>(), 0, 4096);
        let tag = 0x5eed_usize as *mut c_void;
        assert_eq!(nvpoll_submit_read(qp, 1, 0, 8, r, None, tag), 0);
        assert_eq!(nvpoll_qpair_flush(qp), 0);
        let mut out = [NvpollCompletion::default(); 4];
        let deadline = Instant::now() + Duration::from_secs(10);
        let fd = nvpoll_qpair_completion_fd(qp);
        let n = loop {
            let n = nvpoll_qpair_reap(qp, out.as_mut_ptr(), out.len());
            assert!(n >= 0, "{}", last());
            if n > 0 {
                break n;
            }
            assert!(Instant::now() < deadline);
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            libc::poll(&mut p, 1, 100);
        };
        assert_eq!(n, 1);
        assert_eq!((out[0].arg, out[0].buf, out[0].status), (tag, r, 0));
        let got = std::slice::from_raw_parts(nvpoll_buf_data(r).cast::<u8>(), 4096);
        assert_eq!(got, &expect[..]);

        // Blocks beyond the namespace, and a buffer of the wrong size, are refused at submit; the buffer stays
        // the caller's.
        assert_eq!(
            nvpoll_submit_read(qp, 1, ns.blocks, 8, r, None, null_mut()),
            NvpollError::NvpollErrInvalidArgument as c_int
        );
        assert!(last().contains("beyond"), "{}", last());
        assert!(!nvpoll_buf_data(r).is_null());
        assert_eq!(nvpoll_submit_read(qp, 9, 0, 8, r, None, null_mut()), -10);

        // Flush and write zeroes, reaped; then the zeroes read back.
        let mut log2 = Log::default();
        let arg2 = (&raw mut log2).cast::<c_void>();
        assert_eq!(
            nvpoll_submit_write_zeroes(qp, 1, 0, 8, Some(record_cb), arg2),
            0
        );
        assert_eq!(nvpoll_submit_flush(qp, 1, Some(record_cb), arg2), 0);
        assert_eq!(nvpoll_qpair_flush(qp), 0);
        drive(qp, || log2.statuses.len() == 2);
        assert_eq!(log2.statuses, [0, 0]);
        assert_eq!(nvpoll_submit_read(qp, 1, 0, 8, r, Some(record_cb), arg2), 0);
        assert_eq!(nvpoll_qpair_flush(qp), 0);
        drive(qp, || log2.statuses.len() == 3);
        let got = std::slice::from_raw_parts(nvpoll_buf_data(r).cast::<u8>(), 4096);
        assert!(got.iter().all(|&b| b == 0));

        // A queue pair freed with a request in flight: the buffer's memory goes with it, its handle stays to
        // free, and its callback never runs.
        assert_eq!(nvpoll_submit_read(qp, 1, 0, 8, r, Some(record_cb), arg2), 0);
        assert_eq!(nvpoll_qpair_free(qp), 0);
        assert_eq!(log2.statuses.len(), 3);
        assert!(nvpoll_buf_data(r).is_null());
        assert_eq!(nvpoll_buf_free(r), 0);
        assert_eq!(nvpoll_buf_free(w), 0);
        assert_eq!(nvpoll_ctrl_close(ctrl), 0, "{}", last());
        assert_eq!(nvpoll_pool_free(pool), 0);
    }
}

#[test]
fn tls_with_the_key_and_refused_without_it() {
    let key = ConfiguredKey::parse(KEY).unwrap();
    let t = TestTarget::start(|mut c| {
        c.tls = Some(TargetTls::with_host_keys(
            true,
            &[(HOSTNQN.to_string(), key)],
            &[NQN.to_string()],
        ));
        c
    });
    let pool = pool();
    let k = CString::new(KEY).unwrap();
    let ctrl = open(&t, pool, Some(&k)).unwrap_or_else(|e| panic!("{e}: {}", last()));
    // SAFETY: live handles and valid pointers.
    unsafe {
        let mut qp = null_mut();
        assert_eq!(nvpoll_qpair_create(ctrl, 4, &mut qp), 0, "{}", last());
        let b = buf(pool, 4096);
        std::ptr::write_bytes(nvpoll_buf_data(b).cast::<u8>(), 0xa5, 4096);
        let mut log = Log::default();
        let arg = (&raw mut log).cast::<c_void>();
        assert_eq!(nvpoll_submit_write(qp, 2, 3, 1, b, Some(record_cb), arg), 0);
        assert_eq!(nvpoll_qpair_flush(qp), 0);
        drive(qp, || !log.statuses.is_empty());
        assert_eq!(log.statuses, [0]);
        assert_eq!(nvpoll_qpair_free(qp), 0);
        assert_eq!(nvpoll_buf_free(b), 0);
        assert_eq!(nvpoll_ctrl_close(ctrl), 0);
    }
    // Without the key the target, which requires TLS, does not take the host.
    let r = open(&t, pool, None).map(|_| ()).unwrap_err();
    assert!(r < 0, "{r}");
    assert!(!last().is_empty());
    // SAFETY: a live pool.
    assert_eq!(unsafe { nvpoll_pool_free(pool) }, 0);
}

/// Whether `fd` is readable within `ms` milliseconds.
fn readable(fd: c_int, ms: c_int) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    assert!(r >= 0);
    r == 1
}

#[test]
fn the_completion_fd_sleeps_while_idle_and_wakes_for_a_completion() {
    let t = TestTarget::start(|c| c);
    let pool = pool();
    let ctrl = open(&t, pool, None).unwrap_or_else(|e| panic!("{e}: {}", last()));
    // SAFETY: live handles and valid pointers throughout.
    unsafe {
        let mut qp = null_mut();
        assert_eq!(nvpoll_qpair_create(ctrl, 4, &mut qp), 0, "{}", last());
        let fd = nvpoll_qpair_completion_fd(qp);
        assert!(fd >= 0, "{}", last());
        // The same descriptor every time.
        assert_eq!(nvpoll_qpair_completion_fd(qp), fd);
        // Nothing outstanding: nothing to wake for.
        assert!(!readable(fd, 50));
        let b = buf(pool, 4096);
        let mut log = Log::default();
        let arg = (&raw mut log).cast::<c_void>();
        assert_eq!(nvpoll_submit_read(qp, 1, 0, 8, b, Some(record_cb), arg), 0);
        assert_eq!(nvpoll_qpair_flush(qp), 0);
        assert!(readable(fd, 10_000), "the completion fd did not wake");
        let deadline = Instant::now() + Duration::from_secs(10);
        while log.statuses.is_empty() {
            assert!(Instant::now() < deadline);
            assert!(nvpoll_qpair_process_completions(qp, 0) >= 0, "{}", last());
            readable(fd, 100);
        }
        assert_eq!(log.statuses, [0]);
        // Delivered: quiet again.
        assert!(!readable(fd, 50));
        // A completion left for reaping keeps it readable until it is reaped.
        assert_eq!(nvpoll_submit_read(qp, 1, 0, 8, b, None, null_mut()), 0);
        assert_eq!(nvpoll_qpair_flush(qp), 0);
        assert!(readable(fd, 10_000));
        // Processing moves a completion without a callback to the reap list.
        let deadline = Instant::now() + Duration::from_secs(10);
        while nvpoll_qpair_process_completions(qp, 0) == 0 {
            assert!(Instant::now() < deadline);
            readable(fd, 100);
        }
        assert_eq!(nvpoll_qpair_outstanding(qp), 1);
        assert!(readable(fd, 100), "a completion waits to be reaped");
        assert!(readable(fd, 100), "still waiting");
        let mut out = [NvpollCompletion::default(); 1];
        assert_eq!(nvpoll_qpair_reap(qp, out.as_mut_ptr(), 1), 1);
        assert_eq!(out[0].status, 0);
        assert!(!readable(fd, 50));
        assert_eq!(nvpoll_buf_free(b), 0);
        assert_eq!(nvpoll_qpair_free(qp), 0);
        assert_eq!(nvpoll_ctrl_close(ctrl), 0);
        assert_eq!(nvpoll_pool_free(pool), 0);
    }
}
