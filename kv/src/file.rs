//! The kernel's block path as a queue pair: a block device or file opened with O_DIRECT, so that the same
//! engine can run on the kernel's NVMe/TCP block device (`/dev/nvme0n1`) for comparison. `submit` queues;
//! `poll` runs the queued commands one after another with `pread`/`pwrite`/`fdatasync` (each a system call
//! that waits for the device, as a simple engine on O_DIRECT files does) and completes them.

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use nvpoll::api::{Completion, IoOp, IoRequest, Namespace, QueuePair, Rejected};
use nvpoll::Error;

/// A file or block device as a [`QueuePair`] of namespace 1 (4 KiB blocks).
pub struct FileQueuePair {
    file: File,
    blocks: u64,
    depth: usize,
    queued: VecDeque<IoRequest>,
    done: VecDeque<Completion>,
}

/// The block size the file is addressed in.
pub const FILE_BLOCK: u32 = 4096;

impl FileQueuePair {
    /// Opens `path` for reading and writing with O_DIRECT; `depth` commands may wait at once.
    pub fn open(path: &Path, depth: usize) -> Result<FileQueuePair, Error> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(|e| Error::os(format!("opening {} (O_DIRECT)", path.display()), e))?;
        // A block device's length is its seek end (its metadata says 0).
        let len = std::io::Seek::seek(&mut &file, std::io::SeekFrom::End(0))
            .map_err(|e| Error::os(format!("the size of {}", path.display()), e))?;
        Ok(FileQueuePair {
            file,
            blocks: len / u64::from(FILE_BLOCK),
            depth,
            queued: VecDeque::with_capacity(depth),
            done: VecDeque::with_capacity(depth),
        })
    }

    /// The one namespace the file is.
    pub fn namespace(&self) -> Namespace {
        Namespace {
            nsid: 1,
            block_size: FILE_BLOCK,
            blocks: self.blocks,
        }
    }

    fn run(&self, req: &mut IoRequest) -> Result<(), Error> {
        let off = req.lba * u64::from(FILE_BLOCK);
        let len = req.blocks as usize * FILE_BLOCK as usize;
        let io = |e| Error::os("file I/O", e);
        match (req.op, req.buf.as_mut()) {
            (IoOp::Read, Some(b)) => self
                .file
                .read_exact_at(&mut b.as_mut_slice()[..len], off)
                .map_err(io),
            (IoOp::Write, Some(b)) => self
                .file
                .write_all_at(&b.as_slice()[..len], off)
                .map_err(io),
            (IoOp::Flush, _) => self.file.sync_data().map_err(io),
            (op, _) => Err(Error::InvalidArgument(format!(
                "{op:?} is not supported on a file (or has no buffer)"
            ))),
        }
    }
}

impl QueuePair for FileQueuePair {
    fn submit(&mut self, req: IoRequest) -> Result<(), Rejected> {
        if self.queued.len() + self.done.len() >= self.depth {
            return Err(Rejected {
                error: Error::QueueFull,
                request: req,
            });
        }
        self.queued.push_back(req);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), Error> {
        Ok(())
    }

    fn poll(&mut self, max: usize) -> Result<usize, Error> {
        let mut n = 0;
        while n < max {
            let Some(mut req) = self.queued.pop_front() else {
                break;
            };
            let result = self.run(&mut req);
            self.done.push_back(Completion {
                tag: req.tag,
                buf: req.buf,
                result,
            });
            n += 1;
        }
        Ok(n)
    }

    fn pop_completion(&mut self) -> Option<Completion> {
        self.done.pop_front()
    }

    fn outstanding(&self) -> usize {
        self.queued.len() + self.done.len()
    }

    fn depth(&self) -> usize {
        self.depth
    }
}
