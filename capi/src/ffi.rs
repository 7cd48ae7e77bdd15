//! The C functions (`include/nvpoll.h` declares them). Each one catches panics, checks its pointers, and
//! turns every failure into a negative code whose words `nvpoll_last_error_message()` gives.
//!
//! Rules a C caller keeps (the header says them again where they apply):
//!
//! - Handles come from `nvpoll_*_create`, `nvpoll_ctrl_open` and `nvpoll_buf_alloc`, and go back through the
//!   matching free or close, once. A null handle is refused with `NVPOLL_ERR_INVALID_ARGUMENT`.
//! - A queue pair, and the buffers in flight on it, are used by one thread at a time. Different queue pairs
//!   may run on different threads; the controller is used by one thread at a time too.
//! - A buffer handed to a submit belongs to the queue pair until its callback runs (or its entry is reaped);
//!   until then the caller neither touches its memory nor frees it (`NVPOLL_ERR_BUSY`).
//! - A callback runs inside `nvpoll_qpair_process_completions` or `nvpoll_qpair_reap`, on the caller's
//!   thread. It may submit and flush on any queue pair; it may not process, reap or free its own
//!   (`NVPOLL_ERR_BUSY`).
#![allow(unsafe_code)]

use std::any::Any;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use nvpoll_core::api::IoOp;

use crate::error::{self, invalid, Failure, NvpollFault, NvpollRetry};
use crate::handles::{NvpollBuf, NvpollCtrl, NvpollPool, NvpollQpair, OpenOptions, Request};

/// A completion callback: `arg` as given at submit, and `status` 0 for success or a negative
/// `enum nvpoll_error` (during the call, `nvpoll_last_error_message()` describes the failure).
pub type NvpollCb = Option<unsafe extern "C" fn(arg: *mut c_void, status: c_int)>;

/// Options of `nvpoll_ctrl_open`. All zeroes (or a null pointer to this struct) mean the defaults: the
/// transport ID's `hostnqn:` or this machine's host NQN, and no TLS.
#[repr(C)]
#[derive(Debug)]
pub struct NvpollCtrlOpts {
    /// Host NQN (NUL-terminated), or NULL: the transport ID's `hostnqn:`, else /etc/nvme/hostnqn, else one
    /// derived from the machine's UUID.
    pub hostnqn: *const c_char,
    /// TLS 1.3 PSK in the NVMe interchange format (`NVMeTLSkey-1:01:...:`), or NULL for no TLS (NVMe/TCP
    /// only). Every queue then runs TLS before ICReq.
    pub psk: *const c_char,
    /// With `psk`: the TLS PSK identity to present verbatim, or NULL to derive it from the host and
    /// subsystem NQNs.
    pub psk_identity: *const c_char,
    /// With `psk` and no `psk_identity`: the identity version to derive, 0 (NVMe0R0x) or 1 (NVMe1R0x).
    pub psk_identity_version: u8,
}

/// One active namespace.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NvpollNsInfo {
    /// Namespace ID.
    pub nsid: u32,
    /// Logical block size in bytes.
    pub block_size: u32,
    /// Size in logical blocks.
    pub blocks: u64,
}

/// A completion as `nvpoll_qpair_reap` hands it back.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NvpollCompletion {
    /// The `arg` given at submit.
    pub arg: *mut c_void,
    /// The buffer given at submit (NULL for flush and write zeroes): the caller's again.
    pub buf: *mut NvpollBuf,
    /// 0 for success, else a negative `enum nvpoll_error`.
    pub status: c_int,
    /// With `NVPOLL_ERR_NVME`: the completion's 15-bit NVMe status field (SC in bits 7:0, SCT in 10:8, DNR in
    /// bit 14); 0 otherwise.
    pub nvme_status: u16,
}

impl Default for NvpollCompletion {
    fn default() -> Self {
        NvpollCompletion {
            arg: std::ptr::null_mut(),
            buf: std::ptr::null_mut(),
            status: 0,
            nvme_status: 0,
        }
    }
}

/// The words of a caught panic.
fn panic_text(p: Box<dyn Any + Send>) -> String {
    match p.downcast::<String>() {
        Ok(s) => *s,
        Err(p) => match p.downcast::<&'static str>() {
            Ok(s) => (*s).to_string(),
            Err(_) => "a panic without a message".into(),
        },
    }
}

/// Runs `f`, turning its failure or panic into a recorded code.
fn guard(f: impl FnOnce() -> Result<c_int, Failure>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => error::record(&e),
        Err(p) => error::record(&Failure::Internal(panic_text(p))),
    }
}

/// A count as the return value.
fn count(n: usize) -> c_int {
    c_int::try_from(n).unwrap_or(c_int::MAX)
}

/// `p` as a reference, or an invalid-argument failure naming `what` when it is null.
///
/// # Safety
/// A non-null `p` points to a live `T` that nothing else uses for `'a`.
unsafe fn handle<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Failure> {
    // SAFETY: the caller's promise; null is refused by as_mut.
    unsafe { p.as_mut() }.ok_or_else(|| invalid(format!("{what} is NULL")))
}

/// A C string argument: `None` for null, an invalid-argument failure for one that is not UTF-8.
///
/// # Safety
/// A non-null `p` points to a NUL-terminated string alive for `'a`.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, Failure> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's promise.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(Some)
        .map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// The constructors' out-parameter: refuses a NULL `out` before anything is made, then stores what `make`
/// made, boxed, in `*out`.
///
/// # Safety
/// A non-null `out` is valid for a write.
unsafe fn give<T>(
    out: *mut *mut T,
    make: impl FnOnce() -> Result<T, Failure>,
) -> Result<c_int, Failure> {
    if out.is_null() {
        return Err(invalid("out is NULL"));
    }
    let v = make()?;
    // SAFETY: non-null, and valid by the caller's promise.
    unsafe { *out = Box::into_raw(Box::new(v)) };
    Ok(0)
}

// ---- errors ---------------------------------------------------------------------------------------------

/// The words for a return code: a static string, never NULL.
#[no_mangle]
pub extern "C" fn nvpoll_strerror(code: c_int) -> *const c_char {
    error::describe(code).as_ptr()
}

/// The calling thread's last error in full (the error and its causes), or "" if it had none. The string stays
/// valid until this thread's next failing call.
#[no_mangle]
pub extern "C" fn nvpoll_last_error_message() -> *const c_char {
    catch_unwind(error::last_message).unwrap_or(c"".as_ptr())
}

/// The calling thread's last error: what a caller may do about it (`enum nvpoll_retry`).
#[no_mangle]
pub extern "C" fn nvpoll_last_error_retry() -> c_int {
    catch_unwind(|| error::last_classes().0 as c_int)
        .unwrap_or(NvpollRetry::NvpollRetryNever as c_int)
}

/// The calling thread's last error: whose it is (`enum nvpoll_fault`).
#[no_mangle]
pub extern "C" fn nvpoll_last_error_fault() -> c_int {
    catch_unwind(|| error::last_classes().1 as c_int)
        .unwrap_or(NvpollFault::NvpollFaultUnknown as c_int)
}

// ---- DMA pool and buffers -------------------------------------------------------------------------------

/// Creates a DMA pool of `count_4k` buffers of 4 KiB and `large_count` buffers of `large_size` bytes (a power
/// of two of at least 4096; no large class when `large_count` is 0). Hugepages are used when there are enough,
/// ordinary pinned pages otherwise. Stores the pool in `*out`.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_pool_create(
    count_4k: usize,
    large_size: usize,
    large_count: usize,
    out: *mut *mut NvpollPool,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        unsafe { give(out, || NvpollPool::new(count_4k, large_size, large_count)) }
    })
}

/// Frees a pool. Buffers and controllers made from it keep its memory alive until they are freed too.
///
/// # Safety
/// `pool` is NULL or a pool from `nvpoll_pool_create`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_pool_free(pool: *mut NvpollPool) -> c_int {
    guard(|| {
        if pool.is_null() {
            return Err(invalid("pool is NULL"));
        }
        // SAFETY: the caller's promise: a pool of ours, freed once.
        drop(unsafe { Box::from_raw(pool) });
        Ok(0)
    })
}

/// Takes a buffer of `len` bytes from the smallest size class of `pool` that holds it (never a larger one when
/// that class is empty: `NVPOLL_ERR_MEMORY`). Stores the buffer in `*out`.
///
/// # Safety
/// `pool` is NULL or a live pool; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_buf_alloc(
    pool: *mut NvpollPool,
    len: usize,
    out: *mut *mut NvpollBuf,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        let pool = unsafe { handle(pool, "pool") }?;
        // SAFETY: the caller's promise.
        unsafe { give(out, || pool.alloc(len)) }
    })
}

/// Frees a buffer (its memory goes back to its pool). A buffer in flight is refused with `NVPOLL_ERR_BUSY`
/// and stays allocated.
///
/// # Safety
/// `buf` is NULL or a buffer from `nvpoll_buf_alloc`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_buf_free(buf: *mut NvpollBuf) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        let b = unsafe { handle(buf, "buf") }?;
        if b.is_in_flight() {
            return Err(Failure::Busy(
                "the buffer is in flight: free it after its completion".into(),
            ));
        }
        // SAFETY: a buffer of ours, not in flight (no queue pair holds its address), freed once.
        drop(unsafe { Box::from_raw(buf) });
        Ok(0)
    })
}

/// The buffer's memory, at the same address from allocation to free: NULL for a NULL buffer, one in flight,
/// or one whose queue pair was freed while it was in flight.
///
/// # Safety
/// `buf` is NULL or a live buffer.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_buf_data(buf: *mut NvpollBuf) -> *mut c_void {
    // SAFETY: the caller's promise.
    let Ok(b) = (unsafe { handle(buf, "buf") }) else {
        return std::ptr::null_mut();
    };
    catch_unwind(AssertUnwindSafe(|| {
        if b.is_held() {
            b.ptr.cast::<c_void>()
        } else {
            std::ptr::null_mut()
        }
    }))
    .unwrap_or(std::ptr::null_mut())
}

/// The buffer's length in bytes (as allocated); 0 for NULL.
///
/// # Safety
/// `buf` is NULL or a live buffer.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_buf_len(buf: *const NvpollBuf) -> usize {
    // SAFETY: the caller's promise.
    unsafe { buf.as_ref() }.map_or(0, |b| b.len)
}

// ---- controller -----------------------------------------------------------------------------------------

/// Opens the controller a transport ID names, e.g. `trtype:tcp traddr:127.0.0.1 trsvcid:4420 subnqn:NQN` or
/// `trtype:pcie traddr:0000:01:00.0` (bound to vfio-pci), with its DMA memory from `pool` (the buffers of its
/// I/O must come from that pool). NVMe/TCP connects and brings the controller up (with TLS 1.3 when
/// `opts->psk` is set); this blocks for up to a few seconds. Stores the controller in `*out`.
///
/// # Safety
/// `trid` is NULL or a NUL-terminated string; `opts` is NULL or a valid struct whose strings are NULL or
/// NUL-terminated; `pool` is NULL or a live pool; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_ctrl_open(
    trid: *const c_char,
    opts: *const NvpollCtrlOpts,
    pool: *mut NvpollPool,
    out: *mut *mut NvpollCtrl,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        let trid = unsafe { text(trid, "trid") }?.ok_or_else(|| invalid("trid is NULL"))?;
        // SAFETY: the caller's promise.
        let pool = unsafe { handle(pool, "pool") }?;
        // SAFETY: the caller's promise: NULL or a valid struct.
        let o = match unsafe { opts.as_ref() } {
            None => OpenOptions::default(),
            Some(o) => OpenOptions {
                // SAFETY: the caller's promise: NULL or NUL-terminated.
                hostnqn: unsafe { text(o.hostnqn, "opts->hostnqn") }?,
                // SAFETY: as above.
                psk: unsafe { text(o.psk, "opts->psk") }?,
                // SAFETY: as above.
                psk_identity: unsafe { text(o.psk_identity, "opts->psk_identity") }?,
                psk_identity_version: o.psk_identity_version,
            },
        };
        // SAFETY: the caller's promise.
        unsafe { give(out, || NvpollCtrl::open(trid, o, &pool.pool)) }
    })
}

/// Shuts the controller down (CC.SHN) and frees it. Its queue pairs must be freed first: with some still
/// open it answers `NVPOLL_ERR_BUSY` and the controller stays open. Otherwise the handle is freed whatever the
/// result (a failed shutdown still releases it).
///
/// # Safety
/// `ctrl` is NULL or a controller from `nvpoll_ctrl_open`, not closed before.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_ctrl_close(ctrl: *mut NvpollCtrl) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        let c = unsafe { handle(ctrl, "ctrl") }?;
        let open = c.open_qpairs();
        if open > 0 {
            return Err(Failure::Busy(format!(
                "{open} queue pair(s) of this controller are still open: free them first"
            )));
        }
        // SAFETY: a controller of ours, closed once.
        let c = unsafe { Box::from_raw(ctrl) };
        c.close()?;
        Ok(0)
    })
}

/// Services the controller's admin queue: keep-alive, reconnects after a lost connection, health checks.
/// Call it a few times a second (NVMe/TCP's keep-alive timeout is 10 s) from any loop. A failure means the
/// controller is given up.
///
/// # Safety
/// `ctrl` is NULL or a live controller.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_ctrl_poll_admin(ctrl: *mut NvpollCtrl) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        unsafe { handle(ctrl, "ctrl") }?.poll_admin()?;
        Ok(0)
    })
}

/// How many namespaces are active on the controller.
///
/// # Safety
/// `ctrl` is NULL or a live controller.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_ctrl_namespace_count(ctrl: *mut NvpollCtrl) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        Ok(count(
            unsafe { handle(ctrl, "ctrl") }?.info().namespaces.len(),
        ))
    })
}

/// The `index`th active namespace (0 to count - 1, in NSID order as the controller listed them).
///
/// # Safety
/// `ctrl` is NULL or a live controller; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_ctrl_namespace_info(
    ctrl: *mut NvpollCtrl,
    index: u32,
    out: *mut NvpollNsInfo,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        let c = unsafe { handle(ctrl, "ctrl") }?;
        // SAFETY: the caller's promise.
        let out = unsafe { handle(out, "out") }?;
        let all = &c.info().namespaces;
        let ns = all.get(index as usize).ok_or_else(|| {
            invalid(format!(
                "namespace index {index}: the controller has {} active namespace(s)",
                all.len()
            ))
        })?;
        *out = NvpollNsInfo {
            nsid: ns.nsid,
            block_size: ns.block_size,
            blocks: ns.blocks,
        };
        Ok(0)
    })
}

/// The largest transfer of one read or write in bytes (the controller's MDTS and the transport's limit).
///
/// # Safety
/// `ctrl` is NULL or a live controller; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_ctrl_max_transfer(ctrl: *mut NvpollCtrl, out: *mut u32) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        let c = unsafe { handle(ctrl, "ctrl") }?;
        // SAFETY: the caller's promise.
        *unsafe { handle(out, "out") }? = c.info().max_transfer;
        Ok(0)
    })
}

// ---- queue pairs ----------------------------------------------------------------------------------------

/// Connects (NVMe/TCP) or creates (PCIe) an I/O queue pair of `depth` commands on the controller. Stores it
/// in `*out`. The queue pair may then move to the thread that will drive it.
///
/// # Safety
/// `ctrl` is NULL or a live controller; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_qpair_create(
    ctrl: *mut NvpollCtrl,
    depth: u16,
    out: *mut *mut NvpollQpair,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        let c = unsafe { handle(ctrl, "ctrl") }?;
        // SAFETY: the caller's promise.
        unsafe { give(out, || c.create_qpair(depth)) }
    })
}

/// Frees a queue pair (and its completion fd). Requests still in flight are dropped unanswered: their
/// callbacks never run, and their buffers' memory goes back to the pool (`nvpoll_buf_data` then gives NULL;
/// the handles still need `nvpoll_buf_free`). Completions waiting to be reaped give their buffers back. A
/// callback may not free its own queue pair (`NVPOLL_ERR_BUSY`).
///
/// # Safety
/// `qp` is NULL or a queue pair from `nvpoll_qpair_create`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_qpair_free(qp: *mut NvpollQpair) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        if unsafe { handle(qp, "qp") }?.in_callback {
            return Err(Failure::Busy(
                "a callback may not free its own queue pair".into(),
            ));
        }
        // SAFETY: a queue pair of ours, outside its callbacks, freed once.
        drop(unsafe { Box::from_raw(qp) });
        Ok(0)
    })
}

/// Submits one request; see the nvpoll_submit_* functions.
///
/// # Safety
/// `qp` and `buf` are NULL or live handles.
unsafe fn submit(
    qp: *mut NvpollQpair,
    req: Request,
    buf: *mut NvpollBuf,
    cb: NvpollCb,
    arg: *mut c_void,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        let q = unsafe { handle(qp, "qp") }?;
        let b = match req.op {
            IoOp::Read | IoOp::Write => {
                // SAFETY: the caller's promise; a handle distinct from the queue pair.
                Some((unsafe { handle(buf, "buf") }?, buf))
            }
            _ => None,
        };
        q.submit(req, b.map(|(b, p)| (&*b, p)), cb, arg)?;
        Ok(0)
    })
}

/// Submits a read of `blocks` logical blocks from `lba` of namespace `nsid` into `buf`, whose length must be
/// `blocks` times the block size. From now until its completion the buffer is the queue pair's. `cb(arg,
/// status)` runs at completion from `nvpoll_qpair_process_completions` or `nvpoll_qpair_reap`; with `cb` NULL
/// the completion is handed back by `nvpoll_qpair_reap` instead. The request may wait in the queue pair until
/// `nvpoll_qpair_flush`. On failure nothing was submitted and the buffer is still the caller's.
///
/// # Safety
/// `qp` and `buf` are NULL or live handles; `cb`, if not NULL, is safe to call with `arg`.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_submit_read(
    qp: *mut NvpollQpair,
    nsid: u32,
    lba: u64,
    blocks: u32,
    buf: *mut NvpollBuf,
    cb: NvpollCb,
    arg: *mut c_void,
) -> c_int {
    let req = Request {
        op: IoOp::Read,
        nsid,
        lba,
        blocks,
    };
    // SAFETY: the caller's promise.
    unsafe { submit(qp, req, buf, cb, arg) }
}

/// Submits a write of `blocks` logical blocks from `buf` to `lba` of namespace `nsid`; as
/// `nvpoll_submit_read` otherwise.
///
/// # Safety
/// As `nvpoll_submit_read`.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_submit_write(
    qp: *mut NvpollQpair,
    nsid: u32,
    lba: u64,
    blocks: u32,
    buf: *mut NvpollBuf,
    cb: NvpollCb,
    arg: *mut c_void,
) -> c_int {
    let req = Request {
        op: IoOp::Write,
        nsid,
        lba,
        blocks,
    };
    // SAFETY: the caller's promise.
    unsafe { submit(qp, req, buf, cb, arg) }
}

/// Submits a Flush of namespace `nsid`'s volatile write cache (no buffer); as `nvpoll_submit_read`
/// otherwise.
///
/// # Safety
/// `qp` is NULL or a live queue pair; `cb`, if not NULL, is safe to call with `arg`.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_submit_flush(
    qp: *mut NvpollQpair,
    nsid: u32,
    cb: NvpollCb,
    arg: *mut c_void,
) -> c_int {
    let req = Request {
        op: IoOp::Flush,
        nsid,
        lba: 0,
        blocks: 0,
    };
    // SAFETY: the caller's promise.
    unsafe { submit(qp, req, std::ptr::null_mut(), cb, arg) }
}

/// Submits a Write Zeroes of `blocks` logical blocks from `lba` (no buffer); as `nvpoll_submit_read`
/// otherwise.
///
/// # Safety
/// `qp` is NULL or a live queue pair; `cb`, if not NULL, is safe to call with `arg`.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_submit_write_zeroes(
    qp: *mut NvpollQpair,
    nsid: u32,
    lba: u64,
    blocks: u32,
    cb: NvpollCb,
    arg: *mut c_void,
) -> c_int {
    let req = Request {
        op: IoOp::WriteZeroes,
        nsid,
        lba,
        blocks,
    };
    // SAFETY: the caller's promise.
    unsafe { submit(qp, req, std::ptr::null_mut(), cb, arg) }
}

/// Sends everything submitted since the last flush (one write to the socket, or one doorbell). Call it after
/// a batch of submits, and before waiting on the completion fd.
///
/// # Safety
/// `qp` is NULL or a live queue pair.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_qpair_flush(qp: *mut NvpollQpair) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        let q = unsafe { handle(qp, "qp") }?;
        q.flush()?;
        q.rearm()?;
        Ok(0)
    })
}

/// Polls the transport and delivers what completed: runs the callback of each request submitted with one,
/// keeps the others for `nvpoll_qpair_reap`. Returns how many completed (`max` at most from the transport
/// per call; 0: no limit), or a negative code once the queue pair has failed (every request outstanding then
/// completed with an error, delivered by this same call).
///
/// # Safety
/// `qp` is NULL or a live queue pair; the callbacks given at submit are safe to call.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_qpair_process_completions(qp: *mut NvpollQpair, max: u32) -> c_int {
    guard(|| {
        let max = if max == 0 { usize::MAX } else { max as usize };
        // SAFETY: the caller's promise.
        let q = unsafe { handle(qp, "qp") }?;
        if q.in_callback {
            return Err(Failure::Busy(
                "a callback may not process its own queue pair's completions".into(),
            ));
        }
        let polled = q.poll(max);
        // SAFETY: as above; `q` is not used after this point, and each step below borrows the queue pair
        // anew, so that no borrow is alive while a callback (which may submit on it) runs.
        let n = unsafe { deliver(qp, usize::MAX) };
        // SAFETY: as above.
        unsafe { handle(qp, "qp") }?.rearm()?;
        match polled {
            Ok(_) => Ok(count(n)),
            Err(e) => Err(e.into()),
        }
    })
}

/// Takes up to `limit` completions from the transport's done list: runs callbacks, keeps the others for
/// reaping. Returns how many it took.
///
/// # Safety
/// `qp` is a live queue pair, with no reference to it alive; the callbacks are safe to call.
unsafe fn deliver(qp: *mut NvpollQpair, limit: usize) -> usize {
    let mut n = 0;
    while n < limit {
        // SAFETY: the caller's promise; this borrow ends before the callback runs.
        let q = unsafe { &mut *qp };
        let Some(mut done) = q.pop() else { break };
        n += 1;
        let Some(cb) = done.cb else {
            q.keep_for_reap(done);
            continue;
        };
        done.release_buffer();
        let status = done.failure.as_ref().map_or(0, error::record);
        q.in_callback = true;
        // SAFETY: the C caller's function, given at submit, called with its own argument; no borrow of the
        // queue pair is alive across it (the callback may submit on it).
        unsafe { cb(done.arg, status) };
        // SAFETY: the queue pair is still live: a callback may not free it (refused while in_callback).
        unsafe { &mut *qp }.in_callback = false;
    }
    n
}

/// Reaps completions of requests submitted without a callback: polls the transport when fewer than `max`
/// wait (running the callbacks of those submitted with one), then writes up to `max` entries to `out`, oldest
/// first, each buffer the caller's again. Returns how many it wrote, or a negative code (the queue pair
/// failed, and nothing was left to reap). For a failed entry, `nvpoll_last_error_message()` describes the
/// last failed entry of the call.
///
/// # Safety
/// `qp` is NULL or a live queue pair; `out` is NULL or valid for `max` entries; the callbacks are safe to
/// call.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_qpair_reap(
    qp: *mut NvpollQpair,
    out: *mut NvpollCompletion,
    max: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        let q = unsafe { handle(qp, "qp") }?;
        if q.in_callback {
            return Err(Failure::Busy(
                "a callback may not reap its own queue pair".into(),
            ));
        }
        if max > 0 && out.is_null() {
            return Err(invalid("out is NULL"));
        }
        let mut polled = Ok(0);
        if q.ready_len() < max {
            polled = q.poll(max - q.ready_len());
            // SAFETY: `q` is not used after this; see nvpoll_qpair_process_completions.
            unsafe { deliver(qp, usize::MAX) };
        }
        // SAFETY: the caller's promise; no other borrow is alive.
        let q = unsafe { &mut *qp };
        let mut n = 0;
        while n < max {
            let Some(mut done) = q.take_ready() else {
                break;
            };
            done.release_buffer();
            if let Some(f) = &done.failure {
                error::record(f);
            }
            // SAFETY: out is non-null (checked above) and valid for `max` entries; n < max.
            unsafe { out.add(n).write(done.entry()) };
            n += 1;
        }
        q.rearm()?;
        match polled {
            Err(e) if n == 0 => Err(e.into()),
            _ => Ok(count(n)),
        }
    })
}

/// Requests submitted and not yet handed back (in flight, or completed and waiting to be reaped).
///
/// # Safety
/// `qp` is NULL or a live queue pair.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_qpair_outstanding(qp: *mut NvpollQpair) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        Ok(count(unsafe { handle(qp, "qp") }?.outstanding()))
    })
}

/// A file descriptor that becomes readable when the queue pair may have completions: then call
/// `nvpoll_qpair_process_completions` (or `nvpoll_qpair_reap`). It is an epoll descriptor, the same for the
/// queue pair's life (across reconnects), over the queue pair's socket (NVMe/TCP) or interrupt eventfd
/// (PCIe) and a timer for its timeouts; it is readable at once whenever only polling can tell (during a
/// reconnect, or with completions waiting to be reaped). It reflects the queue pair as of the last flush,
/// process or reap: submit, flush, then wait. Never read from it or close it; `nvpoll_qpair_free` closes
/// it. Wait with poll(2), select(2) or epoll. Returns the descriptor, or a negative code
/// (`NVPOLL_ERR_OS` when epoll or timerfd could not be created). Before the first call the queue pair does
/// no work for it.
///
/// # Safety
/// `qp` is NULL or a live queue pair.
#[no_mangle]
pub unsafe extern "C" fn nvpoll_qpair_completion_fd(qp: *mut NvpollQpair) -> c_int {
    guard(|| {
        // SAFETY: the caller's promise.
        let q = unsafe { handle(qp, "qp") }?;
        q.arm_waiter()
    })
}

#[cfg(test)]
#[path = "ffi_tests.rs"]
mod tests;
