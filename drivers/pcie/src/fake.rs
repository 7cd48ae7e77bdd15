//! A memory-backed stand-in for an NVMe PCIe controller, for tests and benchmarks without hardware.
//!
//! [`FakeDevice`] implements [`crate::Device`]: its registers are an array in memory, and it acts on register
//! writes at once, on the caller's thread. Enabling (CC.EN) creates the admin queues from AQA/ASQ/ACQ and sets
//! CSTS.RDY; a submission doorbell makes it fetch every new command, carry it out, and post the completion
//! entry with the right phase tag; disabling resets it. DMA goes through a [`HostMemory`] view of the pools
//! mapped with [`crate::Device::map_dma`], so an unmapped address fails the command as an IOMMU fault would.
//!
//! It walks PRPs as the specification describes (and refuses malformed ones), reads SGL data blocks (when
//! [`FakeConfig::sgls`] says it supports them), keeps namespace data in memory
//! (or throws it away, for benchmarks), and counts doorbells and PRP shapes. Faults can be injected: a fatal
//! status ([`FakeDevice::set_fatal`]), surprise removal ([`FakeDevice::remove`]), commands that never
//! complete ([`FakeDevice::set_stalled`], or I/O commands only: [`FakeDevice::set_io_stalled`]), a
//! controller that cannot be enabled again ([`FakeDevice::set_broken`]), a reset from outside the driver
//! (a function-level reset: [`FakeDevice::function_reset`]), and the kernel asking for the device back
//! (hot removal through VFIO's device request: [`FakeDevice::request_release`]).

use std::sync::{Mutex, MutexGuard};

use nvpoll::mem::DmaPool;
use nvpoll::spec::{
    admin, cns, encode_ns_list, feature, io, reg, sgl_subtype, Aqa, Cap, Cc, Cqe, Csts,
    IdentifyController, IdentifyNamespace, LbaFormat, SglType, Sqe, Status, Vs, CQE_SIZE,
    IDENTIFY_SIZE, SQE_SIZE,
};

use crate::device::Device;
use crate::error::Error;
use crate::mmio::HostMemory;
use crate::prp::PAGE_SIZE;

/// Size of the stand-in's BAR0 (as QEMU's NVMe controller: 16 KiB).
pub const BAR_SIZE: usize = 16 * 1024;

/// One namespace of the stand-in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeNamespace {
    /// Namespace ID.
    pub nsid: u32,
    /// Size in logical blocks.
    pub blocks: u64,
    /// Logical block size in bytes (a power of two, at least 512).
    pub block_size: u32,
}

/// What the stand-in reports and how it behaves.
#[derive(Clone, Debug)]
pub struct FakeConfig {
    /// Namespaces.
    pub namespaces: Vec<FakeNamespace>,
    /// Keep written data (false: a null device that moves no data, for benchmarks).
    pub store_data: bool,
    /// MDTS (in 4 KiB units as a power of two; 0: no limit).
    pub mdts: u8,
    /// CAP.MQES (0-based).
    pub mqes: u16,
    /// CAP.DSTRD.
    pub dstrd: u8,
    /// Most I/O queues it grants.
    pub max_io_queues: u16,
    /// Model number.
    pub model: String,
    /// Identify SGLS: bits 1:0 = 01b SGLs with any alignment, 10b dword-aligned, 00b none.
    pub sgls: u32,
}

impl Default for FakeConfig {
    /// QEMU's NVMe controller as the test guest has it: MDTS 7 (512 KiB), MQES 2047, DSTRD 0, 64 I/O queues,
    /// one namespace of 16 MiB in 512-byte blocks.
    fn default() -> Self {
        FakeConfig {
            namespaces: vec![FakeNamespace {
                nsid: 1,
                blocks: 32768,
                block_size: 512,
            }],
            store_data: true,
            mdts: 7,
            mqes: 2047,
            dstrd: 0,
            max_io_queues: 64,
            model: "nvpoll fake NVMe".into(),
            sgls: 0b01,
        }
    }
}

/// Counters of the stand-in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FakeStats {
    /// Submission doorbell writes (all queues).
    pub sq_doorbells: u64,
    /// Completion doorbell writes (all queues).
    pub cq_doorbells: u64,
    /// Commands carried out (admin and I/O).
    pub commands: u64,
    /// Commands whose data fit in one page (PRP1 only).
    pub prp_one: u64,
    /// Commands with PRP1 and PRP2 as two pages.
    pub prp_two: u64,
    /// Commands with a PRP list.
    pub prp_list: u64,
    /// Commands whose PRP list spanned list pages (chained).
    pub prp_chained: u64,
    /// Commands whose data pointer was an SGL data block.
    pub sgl: u64,
    /// Controller resets (CC.EN 1 -> 0).
    pub resets: u64,
    /// Completions posted into a full completion queue (a driver bug).
    pub cq_overflows: u64,
    /// Commands failed for touching unmapped memory.
    pub dma_faults: u64,
}

#[derive(Clone, Copy, Debug)]
struct Sq {
    base: u64,
    entries: u16,
    head: u16,
    cqid: u16,
}

#[derive(Clone, Copy, Debug)]
struct Cq {
    base: u64,
    entries: u16,
    tail: u16,
    head: u16,
    phase: bool,
}

struct State {
    regs: Vec<u32>,
    mem: HostMemory,
    cfg: FakeConfig,
    data: Vec<Vec<u8>>,
    sqs: Vec<Option<Sq>>,
    cqs: Vec<Option<Cq>>,
    granted: u16,
    fatal: bool,
    removed: bool,
    release_requested: bool,
    released: bool,
    stalled: bool,
    io_stalled: bool,
    broken: bool,
    stats: FakeStats,
    scratch: Vec<u8>,
}

/// The memory-backed controller stand-in; see the module documentation.
pub struct FakeDevice {
    state: Mutex<State>,
}

impl std::fmt::Debug for FakeDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeDevice")
            .field("stats", &self.stats())
            .finish()
    }
}

/// Maximum queue ID the 16 KiB BAR has doorbells for at stride 0.
fn max_qid(dstrd: u8) -> usize {
    (BAR_SIZE - reg::DOORBELLS as usize) / (2 * (4 << dstrd)) - 1
}

impl FakeDevice {
    /// A stand-in configured by `cfg`, disabled (CC.EN = 0), with nothing mapped.
    pub fn new(cfg: FakeConfig) -> FakeDevice {
        let mut cap = Cap(0);
        cap.set_mqes(cfg.mqes);
        cap.set_cqr(true);
        cap.set_to(2);
        cap.set_dstrd(cfg.dstrd);
        cap.set_css(Cap::CSS_NVM);
        cap.set_mpsmax(4);
        let mut regs = vec![0u32; BAR_SIZE / 4];
        regs[reg::CAP as usize / 4] = cap.0 as u32;
        regs[reg::CAP as usize / 4 + 1] = (cap.0 >> 32) as u32;
        regs[reg::VS as usize / 4] = Vs::V1_4.0;
        let data = cfg
            .namespaces
            .iter()
            .map(|n| {
                if cfg.store_data {
                    vec![0u8; (n.blocks * u64::from(n.block_size)) as usize]
                } else {
                    Vec::new()
                }
            })
            .collect();
        let nq = max_qid(cfg.dstrd) + 1;
        FakeDevice {
            state: Mutex::new(State {
                regs,
                mem: HostMemory::new(),
                data,
                sqs: vec![None; nq],
                cqs: vec![None; nq],
                granted: 0,
                fatal: false,
                removed: false,
                release_requested: false,
                released: false,
                stalled: false,
                io_stalled: false,
                broken: false,
                stats: FakeStats::default(),
                scratch: Vec::new(),
                cfg,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The counters.
    pub fn stats(&self) -> FakeStats {
        self.lock().stats
    }

    /// Reports a fatal status (CSTS.CFS) and stops processing commands until the next reset.
    pub fn set_fatal(&self) {
        let mut s = self.lock();
        s.fatal = true;
        let i = reg::CSTS as usize / 4;
        s.regs[i] |= 1 << 1;
    }

    /// Surprise removal: from now on every register reads as all ones and writes are lost.
    pub fn remove(&self) {
        self.lock().removed = true;
    }

    /// The kernel asks for the device back (as VFIO's device request on hot removal): the device keeps
    /// working until the driver releases it ([`crate::Device::release`]).
    pub fn request_release(&self) {
        self.lock().release_requested = true;
    }

    /// Whether the driver released the device (after which it reads as removed and maps nothing).
    pub fn released(&self) -> bool {
        self.lock().released
    }

    /// How many DMA regions are mapped now.
    pub fn mapped_regions(&self) -> usize {
        self.lock().mem.regions()
    }

    /// A reset from outside the driver (a function-level reset through sysfs): the controller is disabled,
    /// every queue is gone and the admin queue registers are cleared.
    pub fn function_reset(&self) {
        let mut s = self.lock();
        // Disabling drops every queue and clears CSTS; a function reset also clears the admin queue registers.
        s.write_cc(Cc(0));
        for r in [reg::AQA, reg::ASQ, reg::ASQ + 4, reg::ACQ, reg::ACQ + 4] {
            s.regs[r as usize / 4] = 0;
        }
    }

    /// While set, commands are fetched but never completed.
    pub fn set_stalled(&self, stalled: bool) {
        self.lock().stalled = stalled;
    }

    /// While set, I/O commands are fetched but never completed; admin commands still are (so a reset
    /// completes, and loses the I/O commands).
    pub fn set_io_stalled(&self, stalled: bool) {
        self.lock().io_stalled = stalled;
    }

    /// While set, enabling the controller (CC.EN 0 -> 1) fails with a fatal status: a reset cannot bring it
    /// back.
    pub fn set_broken(&self, broken: bool) {
        self.lock().broken = broken;
    }

    /// The I/O submission queues that exist now.
    pub fn io_queues(&self) -> Vec<u16> {
        let s = self.lock();
        (1..s.sqs.len())
            .filter(|&q| s.sqs[q].is_some())
            .map(|q| q as u16)
            .collect()
    }

    /// A copy of `blocks` blocks at `lba` of namespace `nsid` (empty for a null device or a bad range).
    pub fn read_blocks(&self, nsid: u32, lba: u64, blocks: u32) -> Vec<u8> {
        let s = self.lock();
        let Some(i) = s.cfg.namespaces.iter().position(|n| n.nsid == nsid) else {
            return Vec::new();
        };
        let bs = u64::from(s.cfg.namespaces[i].block_size);
        let (start, end) = (
            (lba * bs) as usize,
            ((lba + u64::from(blocks)) * bs) as usize,
        );
        s.data[i]
            .get(start..end)
            .map(<[u8]>::to_vec)
            .unwrap_or_default()
    }
}

impl Device for FakeDevice {
    fn read32(&self, offset: usize) -> u32 {
        let s = self.lock();
        if s.removed {
            return u32::MAX;
        }
        s.regs.get(offset / 4).copied().unwrap_or(0)
    }

    fn write32(&self, offset: usize, value: u32) {
        let mut s = self.lock();
        if s.removed || offset / 4 >= s.regs.len() {
            return;
        }
        if offset >= reg::DOORBELLS as usize {
            let stride = 4usize << s.cfg.dstrd;
            let index = (offset - reg::DOORBELLS as usize) / stride;
            let qid = index / 2;
            if index % 2 == 0 {
                s.stats.sq_doorbells += 1;
                s.ring_sq(qid, value as u16);
            } else {
                s.stats.cq_doorbells += 1;
                if let Some(cq) = s.cqs.get_mut(qid).and_then(|c| c.as_mut()) {
                    cq.head = value as u16;
                }
            }
            return;
        }
        if offset == reg::CC as usize {
            s.write_cc(Cc(value));
            return;
        }
        if offset == reg::CSTS as usize {
            return; // read-only
        }
        s.regs[offset / 4] = value;
    }

    fn map_dma(&self, pool: &DmaPool) -> Result<(), Error> {
        let mut s = self.lock();
        if s.released {
            return Err(Error::Removed);
        }
        s.mem.add(pool);
        Ok(())
    }

    fn unmap_dma(&self, pool: &DmaPool) -> Result<(), Error> {
        self.lock().mem.remove(pool);
        Ok(())
    }

    fn name(&self) -> String {
        "fake".into()
    }

    fn is_present(&self) -> bool {
        !self.lock().removed
    }

    fn release_requested(&self) -> bool {
        self.lock().release_requested
    }

    fn release(&self) {
        let mut s = self.lock();
        s.removed = true;
        s.released = true;
        s.mem = HostMemory::new();
    }
}

/// How a command's data is laid out in host memory: (IOVA, length) segments.
type Segments = Vec<(u64, u64)>;

impl State {
    fn reg64(&self, offset: u32) -> u64 {
        let i = offset as usize / 4;
        u64::from(self.regs[i]) | u64::from(self.regs[i + 1]) << 32
    }

    fn set_csts(&mut self, csts: Csts) {
        self.regs[reg::CSTS as usize / 4] = csts.0;
    }

    fn csts(&self) -> Csts {
        Csts(self.regs[reg::CSTS as usize / 4])
    }

    fn write_cc(&mut self, cc: Cc) {
        let old = Cc(self.regs[reg::CC as usize / 4]);
        self.regs[reg::CC as usize / 4] = cc.0;
        if old.en() && !cc.en() {
            // Controller reset: every queue is gone, CSTS (including CFS) clears.
            self.stats.resets += 1;
            self.sqs.iter_mut().for_each(|q| *q = None);
            self.cqs.iter_mut().for_each(|q| *q = None);
            self.granted = 0;
            self.fatal = false;
            self.set_csts(Csts(0));
            return;
        }
        if !old.en() && cc.en() {
            let aqa = Aqa(self.regs[reg::AQA as usize / 4]);
            let (asq, acq) = (self.reg64(reg::ASQ), self.reg64(reg::ACQ));
            let ok = cc.iosqes() == 6
                && cc.iocqes() == 4
                && cc.mps() == 0
                && asq % PAGE_SIZE == 0
                && acq % PAGE_SIZE == 0
                && asq != 0
                && acq != 0;
            let mut csts = self.csts();
            if !ok || self.fatal || self.broken {
                csts.set_cfs(true);
                self.set_csts(csts);
                return;
            }
            self.sqs[0] = Some(Sq {
                base: asq,
                entries: aqa.asqs() + 1,
                head: 0,
                cqid: 0,
            });
            self.cqs[0] = Some(Cq {
                base: acq,
                entries: aqa.acqs() + 1,
                tail: 0,
                head: 0,
                phase: true,
            });
            csts.set_rdy(true);
            self.set_csts(csts);
        }
        if cc.en() && cc.shn() != Cc::SHN_NONE {
            let mut csts = self.csts();
            csts.set_shst(Csts::SHST_COMPLETE);
            self.set_csts(csts);
        }
    }

    fn ring_sq(&mut self, qid: usize, tail: u16) {
        if self.fatal || !self.csts().rdy() {
            return;
        }
        let Some(mut sq) = self.sqs.get(qid).copied().flatten() else {
            return;
        };
        if tail >= sq.entries {
            // An invalid doorbell write: real controllers post an asynchronous event; the stand-in goes fatal.
            self.fatal = true;
            let mut csts = self.csts();
            csts.set_cfs(true);
            self.set_csts(csts);
            return;
        }
        while sq.head != tail {
            let mut raw = [0u8; SQE_SIZE];
            let addr = sq.base + u64::from(sq.head) * SQE_SIZE as u64;
            sq.head = (sq.head + 1) % sq.entries;
            self.sqs[qid] = Some(sq);
            if !self.mem.read(addr, &mut raw) {
                self.stats.dma_faults += 1;
                continue;
            }
            let sqe = Sqe::from_bytes(&raw).expect("64 bytes");
            if self.stalled || (qid != 0 && self.io_stalled) {
                continue;
            }
            self.stats.commands += 1;
            let (status, dw0) = if qid == 0 {
                self.admin_command(&sqe)
            } else {
                (self.io_command(&sqe), 0)
            };
            self.post(sq.cqid, qid as u16, sq.head, sqe.cid, status, dw0);
            // A command may have deleted this very queue.
            match self.sqs.get(qid).copied().flatten() {
                Some(s) => sq = s,
                None => return,
            }
        }
    }

    fn post(&mut self, cqid: u16, sqid: u16, sqhd: u16, cid: u16, status: Status, dw0: u32) {
        let Some(cq) = self.cqs.get_mut(usize::from(cqid)).and_then(|c| c.as_mut()) else {
            return;
        };
        if (cq.tail + 1) % cq.entries == cq.head {
            self.stats.cq_overflows += 1;
        }
        let mut cqe = Cqe {
            dw0,
            dw1: 0,
            sqhd,
            sqid,
            cid,
            status_phase: 0,
        };
        cqe.set_status(status, cq.phase);
        let addr = cq.base + u64::from(cq.tail) * CQE_SIZE as u64;
        cq.tail += 1;
        if cq.tail == cq.entries {
            cq.tail = 0;
            cq.phase = !cq.phase;
        }
        if !self.mem.write(addr, &cqe.to_bytes()) {
            self.stats.dma_faults += 1;
        }
    }

    /// Where the data of a transfer of `len` bytes is: walks the PRPs (counting their shape), or reads the
    /// SGL data block, as a controller does.
    fn walk_prps(&mut self, sqe: &Sqe, len: u64) -> Result<Segments, Status> {
        match sqe.flags & 0xc0 {
            0 => {}
            Sqe::PSDT_SGL if self.cfg.sgls & 0x3 != 0 => {
                let d = sqe.sgl();
                if d.sgl_type != SglType::DataBlock || d.subtype != sgl_subtype::ADDRESS {
                    return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID);
                }
                if u64::from(d.length) != len {
                    return Err(Status::DATA_SGL_LENGTH_INVALID);
                }
                if self.cfg.sgls & 0x3 == 0b10 && d.address & 3 != 0 {
                    return Err(Status::INVALID_FIELD);
                }
                self.stats.sgl += 1;
                return Ok(vec![(d.address, len)]);
            }
            _ => return Err(Status::INVALID_FIELD),
        }
        let (prp1, prp2) = (sqe.dptr1, sqe.dptr2);
        if prp1 & 3 != 0 {
            return Err(Status::INVALID_FIELD);
        }
        let mut segs = Vec::new();
        let first = (PAGE_SIZE - (prp1 & (PAGE_SIZE - 1))).min(len);
        segs.push((prp1, first));
        let mut left = len - first;
        if left == 0 {
            self.stats.prp_one += 1;
            return Ok(segs);
        }
        if prp2 & (PAGE_SIZE - 1) != 0 && left <= PAGE_SIZE {
            return Err(Status::INVALID_FIELD);
        }
        if left <= PAGE_SIZE {
            self.stats.prp_two += 1;
            segs.push((prp2, left));
            return Ok(segs);
        }
        if prp2 & 7 != 0 {
            return Err(Status::INVALID_FIELD);
        }
        self.stats.prp_list += 1;
        let mut entry = prp2;
        let mut chained = false;
        while left > 0 {
            let mut b = [0u8; 8];
            if !self.mem.read(entry, &mut b) {
                self.stats.dma_faults += 1;
                return Err(Status::DATA_TRANSFER_ERROR);
            }
            let v = u64::from_le_bytes(b);
            if v & (PAGE_SIZE - 1) != 0 {
                return Err(Status::INVALID_FIELD);
            }
            if entry & (PAGE_SIZE - 1) == PAGE_SIZE - 8 && left > PAGE_SIZE {
                chained = true;
                entry = v;
                continue;
            }
            let n = left.min(PAGE_SIZE);
            match segs.last_mut() {
                Some(last) if last.0 + last.1 == v => last.1 += n,
                _ => segs.push((v, n)),
            }
            left -= n;
            entry += 8;
        }
        if chained {
            self.stats.prp_chained += 1;
        }
        Ok(segs)
    }

    fn dma_out(&mut self, segs: &Segments, data: &[u8]) -> Status {
        let mut off = 0usize;
        for &(iova, n) in segs {
            if !self.mem.write(iova, &data[off..off + n as usize]) {
                self.stats.dma_faults += 1;
                return Status::DATA_TRANSFER_ERROR;
            }
            off += n as usize;
        }
        Status::SUCCESS
    }

    fn dma_in(&mut self, segs: &Segments, out: &mut [u8]) -> Status {
        let mut off = 0usize;
        for &(iova, n) in segs {
            if !self.mem.read(iova, &mut out[off..off + n as usize]) {
                self.stats.dma_faults += 1;
                return Status::DATA_TRANSFER_ERROR;
            }
            off += n as usize;
        }
        Status::SUCCESS
    }

    fn identify_controller(&self) -> [u8; IDENTIFY_SIZE] {
        let id = IdentifyController {
            vid: 0x1b36,
            ssvid: 0x1af4,
            serial: "NVPOLLFAKE".into(),
            model: self.cfg.model.clone(),
            firmware: "1.0".into(),
            mdts: self.cfg.mdts,
            ver: Vs::V1_4,
            cntrltype: IdentifyController::CNTRLTYPE_IO,
            sqes: 0x66,
            cqes: 0x44,
            maxcmd: 0,
            nn: self
                .cfg
                .namespaces
                .iter()
                .map(|n| n.nsid)
                .max()
                .unwrap_or(0),
            oncs: 1 << 3,
            vwc: 1,
            sgls: self.cfg.sgls,
            ..Default::default()
        };
        id.to_bytes()
    }

    /// The queue ID of a Create I/O CQ or SQ command, if it is one of the granted I/O queues and `queues` has no
    /// queue of that ID yet.
    fn new_qid<Q>(&self, sqe: &Sqe, queues: &[Option<Q>]) -> Option<usize> {
        let qid = (sqe.cdw10 & 0xffff) as usize;
        (qid != 0 && qid <= usize::from(self.granted) && queues[qid].is_none()).then_some(qid)
    }

    /// The base address and the size (entries) of the queue that a Create I/O CQ or SQ command with entries of
    /// `entry_size` bytes asks for: a size the controller supports, in physically contiguous, page-aligned
    /// memory that the host mapped.
    fn queue_memory(&self, sqe: &Sqe, entry_size: usize) -> Result<(u64, u32), Status> {
        let size = (sqe.cdw10 >> 16) + 1;
        if size < 2 || size > u32::from(self.cfg.mqes) + 1 {
            return Err(Status::INVALID_QUEUE_SIZE);
        }
        let base = sqe.dptr1;
        let bytes = size as usize * entry_size;
        if sqe.cdw11 & 1 == 0 || base % PAGE_SIZE != 0 || !self.mem.contains(base, bytes) {
            return Err(Status::INVALID_FIELD);
        }
        Ok((base, size))
    }

    fn admin_command(&mut self, sqe: &Sqe) -> (Status, u32) {
        match sqe.opcode {
            admin::IDENTIFY => {
                let page = match (sqe.cdw10 & 0xff) as u8 {
                    cns::CONTROLLER => self.identify_controller(),
                    cns::NAMESPACE => {
                        let Some(n) = self.cfg.namespaces.iter().find(|n| n.nsid == sqe.nsid)
                        else {
                            return (Status::INVALID_NAMESPACE, 0);
                        };
                        IdentifyNamespace {
                            nsze: n.blocks,
                            ncap: n.blocks,
                            nuse: n.blocks,
                            lbaf: vec![LbaFormat {
                                ms: 0,
                                lbads: n.block_size.trailing_zeros() as u8,
                                rp: 0,
                            }],
                            ..Default::default()
                        }
                        .to_bytes()
                    }
                    cns::ACTIVE_NS_LIST => {
                        let ids: Vec<u32> = self
                            .cfg
                            .namespaces
                            .iter()
                            .map(|n| n.nsid)
                            .filter(|&id| id > sqe.nsid)
                            .collect();
                        encode_ns_list(&ids)
                    }
                    _ => return (Status::INVALID_FIELD, 0),
                };
                match self.walk_prps(sqe, IDENTIFY_SIZE as u64) {
                    Ok(segs) => (self.dma_out(&segs, &page), 0),
                    Err(st) => (st, 0),
                }
            }
            admin::SET_FEATURES | admin::GET_FEATURES
                if (sqe.cdw10 & 0xff) as u8 == feature::NUMBER_OF_QUEUES =>
            {
                if sqe.opcode == admin::SET_FEATURES {
                    let (nsq, ncq) = feature::num_queues_granted(sqe.cdw11);
                    let max = u32::from(self.cfg.max_io_queues).min(max_qid(self.cfg.dstrd) as u32);
                    self.granted = nsq.min(ncq).min(max) as u16;
                }
                let g = u32::from(self.granted.max(1)) - 1;
                (Status::SUCCESS, g | g << 16)
            }
            admin::CREATE_IO_CQ => {
                let Some(qid) = self.new_qid(sqe, &self.cqs) else {
                    return (Status::INVALID_QUEUE_ID, 0);
                };
                let (base, size) = match self.queue_memory(sqe, CQE_SIZE) {
                    Ok(m) => m,
                    Err(status) => return (status, 0),
                };
                self.cqs[qid] = Some(Cq {
                    base,
                    entries: size as u16,
                    tail: 0,
                    head: 0,
                    phase: true,
                });
                (Status::SUCCESS, 0)
            }
            admin::CREATE_IO_SQ => {
                let cqid = (sqe.cdw11 >> 16) as usize;
                let Some(qid) = self.new_qid(sqe, &self.sqs) else {
                    return (Status::INVALID_QUEUE_ID, 0);
                };
                if cqid == 0 || self.cqs.get(cqid).is_none_or(|c| c.is_none()) {
                    return (Status::CQ_INVALID, 0);
                }
                let (base, size) = match self.queue_memory(sqe, SQE_SIZE) {
                    Ok(m) => m,
                    Err(status) => return (status, 0),
                };
                self.sqs[qid] = Some(Sq {
                    base,
                    entries: size as u16,
                    head: 0,
                    cqid: cqid as u16,
                });
                (Status::SUCCESS, 0)
            }
            admin::DELETE_IO_SQ => {
                let qid = (sqe.cdw10 & 0xffff) as usize;
                if qid == 0 || self.sqs.get(qid).is_none_or(|s| s.is_none()) {
                    return (Status::INVALID_QUEUE_ID, 0);
                }
                self.sqs[qid] = None;
                (Status::SUCCESS, 0)
            }
            admin::DELETE_IO_CQ => {
                let qid = (sqe.cdw10 & 0xffff) as usize;
                if qid == 0 || self.cqs.get(qid).is_none_or(|c| c.is_none()) {
                    return (Status::INVALID_QUEUE_ID, 0);
                }
                if self
                    .sqs
                    .iter()
                    .flatten()
                    .any(|s| usize::from(s.cqid) == qid)
                {
                    return (Status::INVALID_QUEUE_DELETION, 0);
                }
                self.cqs[qid] = None;
                (Status::SUCCESS, 0)
            }
            _ => (Status::INVALID_OPCODE, 0),
        }
    }

    fn io_command(&mut self, sqe: &Sqe) -> Status {
        let Some(i) = self.cfg.namespaces.iter().position(|n| n.nsid == sqe.nsid) else {
            return Status::INVALID_NAMESPACE;
        };
        let ns = self.cfg.namespaces[i].clone();
        match sqe.opcode {
            io::FLUSH => Status::SUCCESS,
            io::READ | io::WRITE | io::WRITE_ZEROES => {
                let blocks = u64::from(sqe.nlb_zero_based()) + 1;
                let lba = sqe.slba();
                if lba.checked_add(blocks).is_none_or(|end| end > ns.blocks) {
                    return Status::LBA_OUT_OF_RANGE;
                }
                let bs = u64::from(ns.block_size);
                let (start, len) = ((lba * bs) as usize, blocks * bs);
                if sqe.opcode == io::WRITE_ZEROES {
                    if self.cfg.store_data {
                        self.data[i][start..start + len as usize].fill(0);
                    }
                    return Status::SUCCESS;
                }
                if self.cfg.mdts != 0 && len > PAGE_SIZE << self.cfg.mdts {
                    return Status::INVALID_FIELD;
                }
                if !self.cfg.store_data {
                    return Status::SUCCESS;
                }
                let segs = match self.walk_prps(sqe, len) {
                    Ok(s) => s,
                    Err(st) => return st,
                };
                let mut scratch = std::mem::take(&mut self.scratch);
                scratch.resize(len as usize, 0);
                let st = if sqe.opcode == io::WRITE {
                    let st = self.dma_in(&segs, &mut scratch);
                    if st.is_success() {
                        self.data[i][start..start + len as usize].copy_from_slice(&scratch);
                    }
                    st
                } else {
                    scratch.copy_from_slice(&self.data[i][start..start + len as usize]);
                    self.dma_out(&segs, &scratch)
                };
                self.scratch = scratch;
                st
            }
            _ => Status::INVALID_OPCODE,
        }
    }
}
