// A controller and queue pair kept in memory, for the core crate's doctests only: they include it in hidden
// lines (`# mod ram { include!("doctest/ram.rs"); }`) so that their examples run a real `QueuePair` without a
// target or a device. It is not a module of the crate and is not built with it.
//
// Namespace 1 is a RAM disk of `BLOCKS` blocks of `BLOCK_SIZE` bytes. A request is checked by
// `nvpoll::api::check_request` when it is submitted, leaves at `flush` and completes (reads and writes done on
// the RAM disk) at the next `poll`, in order. The controller answers Identify Controller and refuses every
// other admin command (Invalid Command Opcode).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use nvpoll::api::{
    check_request, Completion, Controller, ControllerInfo, IoOp, IoRequest, Namespace, QueuePair,
    QueueStats, Rejected,
};
use nvpoll::mem::DmaBuf;
use nvpoll::spec::{Cqe, IdentifyController, Sqe, Status, IDENTIFY_SIZE};
use nvpoll::{Error, Result};

/// Namespace 1's logical block size.
pub const BLOCK_SIZE: u32 = 512;
/// Namespace 1's size in blocks.
pub const BLOCKS: u64 = 1024;

/// The controller: namespace 1 on a RAM disk.
pub struct RamController {
    info: ControllerInfo,
    disk: Rc<RefCell<Vec<u8>>>,
}

impl RamController {
    /// A controller with an empty (zeroed) namespace 1.
    pub fn new() -> RamController {
        let identify = IdentifyController {
            model: "nvpoll RAM disk".into(),
            ..Default::default()
        };
        RamController {
            info: ControllerInfo {
                identify,
                namespaces: vec![Namespace { nsid: 1, block_size: BLOCK_SIZE, blocks: BLOCKS }],
                max_transfer: 128 * 1024,
            },
            disk: Rc::new(RefCell::new(vec![0; (BLOCKS * u64::from(BLOCK_SIZE)) as usize])),
        }
    }
}

impl Controller for RamController {
    type QueuePair = RamQueuePair;

    fn info(&self) -> &ControllerInfo {
        &self.info
    }

    fn admin(&mut self, cmd: Sqe, mut buf: Option<DmaBuf>) -> Result<(Cqe, Option<DmaBuf>)> {
        let mut cqe = Cqe { cid: cmd.cid, ..Cqe::default() };
        let identify = Sqe::identify(1, 0);
        if cmd.opcode == identify.opcode && cmd.cdw10 == identify.cdw10 {
            match buf.as_mut() {
                Some(b) if b.len() >= IDENTIFY_SIZE => {
                    b[..IDENTIFY_SIZE].copy_from_slice(&self.info.identify.to_bytes())
                }
                _ => return Err(Error::InvalidArgument("Identify needs a 4 KiB buffer".into())),
            }
        } else {
            cqe.set_status(Status::INVALID_OPCODE, false);
        }
        Ok((cqe, buf))
    }

    fn create_queue_pair(&mut self, depth: u16) -> Result<RamQueuePair> {
        Ok(RamQueuePair {
            disk: Rc::clone(&self.disk),
            namespaces: self.info.namespaces.clone(),
            max_transfer: self.info.max_transfer,
            depth: usize::from(depth),
            queued: Vec::new(),
            sent: VecDeque::new(),
            done: VecDeque::new(),
            stats: QueueStats::default(),
        })
    }
}

/// A queue pair of the RAM controller.
pub struct RamQueuePair {
    disk: Rc<RefCell<Vec<u8>>>,
    namespaces: Vec<Namespace>,
    max_transfer: u32,
    depth: usize,
    queued: Vec<IoRequest>,
    sent: VecDeque<IoRequest>,
    done: VecDeque<Completion>,
    stats: QueueStats,
}

impl RamQueuePair {
    /// A queue pair of `depth` on a controller of its own.
    pub fn new(depth: u16) -> RamQueuePair {
        RamController::new().create_queue_pair(depth).expect("a RAM queue pair")
    }

    fn execute(&self, req: &mut IoRequest) -> Result<()> {
        let start = (req.lba * u64::from(BLOCK_SIZE)) as usize;
        let len = req.blocks as usize * BLOCK_SIZE as usize;
        let mut disk = self.disk.borrow_mut();
        let wrong = || Error::InvalidArgument("the buffer is not the request's size".into());
        match req.op {
            IoOp::Read => {
                let buf = req.buf.as_mut().filter(|b| b.len() == len).ok_or_else(wrong)?;
                buf.copy_from_slice(&disk[start..start + len]);
            }
            IoOp::Write => {
                let buf = req.buf.as_ref().filter(|b| b.len() == len).ok_or_else(wrong)?;
                disk[start..start + len].copy_from_slice(buf);
            }
            IoOp::WriteZeroes | IoOp::Deallocate => disk[start..start + len].fill(0),
            IoOp::Flush => {}
        }
        Ok(())
    }
}

impl QueuePair for RamQueuePair {
    fn submit(&mut self, mut req: IoRequest) -> std::result::Result<(), Rejected> {
        if self.outstanding() >= self.depth {
            return Err(Rejected { error: Error::QueueFull, request: req });
        }
        if let Err(error) = check_request(&mut req, &self.namespaces, self.max_transfer) {
            return Err(Rejected { error, request: req });
        }
        self.stats.commands += 1;
        self.queued.push(req);
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if !self.queued.is_empty() {
            self.stats.writes += 1;
            self.stats.pdus += self.queued.len() as u64;
            self.sent.extend(self.queued.drain(..));
        }
        Ok(())
    }

    fn poll(&mut self, max: usize) -> Result<usize> {
        let n = self.sent.len().min(max);
        for _ in 0..n {
            let mut req = self.sent.pop_front().expect("n requests were sent");
            let result = self.execute(&mut req).map(|()| Cqe::default());
            self.done.push_back(Completion::from_result(req.tag, req.buf, result));
        }
        if n > 0 {
            self.stats.reads += 1;
        }
        Ok(n)
    }

    fn pop_completion(&mut self) -> Option<Completion> {
        self.done.pop_front()
    }

    fn outstanding(&self) -> usize {
        self.queued.len() + self.sent.len() + self.done.len()
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn stats(&self) -> QueueStats {
        self.stats
    }
}
