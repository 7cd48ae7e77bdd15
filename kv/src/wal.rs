//! The write-ahead log: 4 KiB records from LBA 0, group commit, recovery (see the [crate] docs).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Poll, Waker};

use nvpoll::aio::AsyncQueue;
use nvpoll::api::{Namespace, QueuePair};
use nvpoll::mem::DmaPool;

/// The size of one log record.
pub const BLOCK: usize = 4096;
const MAGIC: &[u8; 4] = b"NVKV";
const HEADER: usize = 32;
/// The most bytes of entries one record carries.
pub const PAYLOAD: usize = BLOCK - HEADER;

/// Why the log failed.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    /// The device failed a read, a write or a flush; the log takes no more puts after a failed write.
    #[error("the log's device: {0}")]
    Io(#[from] nvpoll::Error),
    /// One entry must fit one record.
    #[error(
        "an entry of {len} bytes does not fit one record ({PAYLOAD} bytes, 4 of them its lengths)"
    )]
    TooBig {
        /// The entry's key, value and lengths.
        len: usize,
    },
    /// The namespace has no room for another record.
    #[error("the log is full ({0} records)")]
    Full(u64),
    /// An earlier write failed: the log is closed to puts.
    #[error("the log failed earlier: {0}")]
    Failed(String),
    /// The namespace cannot hold the log (blocks larger than a record, or not a whole number of them).
    #[error("a namespace of {0}-byte blocks cannot hold 4 KiB records")]
    BlockSize(u32),
}

/// What recovery found: the entries of every whole record, in order, and where the log goes on.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Every (key, value) in log order.
    pub entries: Vec<(Vec<u8>, Vec<u8>)>,
    /// Whole records read.
    pub records: u64,
    /// Whether the log ended at a record that was not whole (a torn write) rather than at an empty one.
    pub torn_tail: bool,
}

struct State {
    /// The next record's position (in records from LBA 0).
    next_pos: u64,
    /// Entries waiting for a record: (sequence number, key, value).
    pending: VecDeque<(u64, Vec<u8>, Vec<u8>)>,
    next_seq: u64,
    /// Every entry with a sequence number below this is durable.
    durable: u64,
    waiters: Vec<(u64, Waker)>,
    committer: Option<Waker>,
    failed: Option<String>,
    closing: bool,
    /// Records written and entries they carried.
    records: u64,
    entries: u64,
}

struct Inner<Q: QueuePair> {
    q: AsyncQueue<Q>,
    pool: DmaPool,
    nsid: u32,
    /// LBAs per record.
    lbas: u32,
    /// Records the namespace holds.
    capacity: u64,
    st: RefCell<State>,
}

/// The write-ahead log on one namespace (see the [crate] docs). Cloning gives another handle.
pub struct Wal<Q: QueuePair> {
    inner: Rc<Inner<Q>>,
}

impl<Q: QueuePair> Clone for Wal<Q> {
    fn clone(&self) -> Self {
        Wal {
            inner: Rc::clone(&self.inner),
        }
    }
}

/// Encodes `entries` into `block` as record `pos`.
fn encode(block: &mut [u8], pos: u64, entries: &[(u64, Vec<u8>, Vec<u8>)]) {
    block.fill(0);
    let mut at = HEADER;
    for (_, k, v) in entries {
        block[at..at + 2].copy_from_slice(&(k.len() as u16).to_le_bytes());
        block[at + 2..at + 4].copy_from_slice(&(v.len() as u16).to_le_bytes());
        at += 4;
        block[at..at + k.len()].copy_from_slice(k);
        at += k.len();
        block[at..at + v.len()].copy_from_slice(v);
        at += v.len();
    }
    block[0..4].copy_from_slice(MAGIC);
    block[8..16].copy_from_slice(&pos.to_le_bytes());
    block[16..18].copy_from_slice(&(entries.len() as u16).to_le_bytes());
    block[20..24].copy_from_slice(&((at - HEADER) as u32).to_le_bytes());
    let crc = crc32c::crc32c(block);
    block[4..8].copy_from_slice(&crc.to_le_bytes());
}

/// What a block read back holds: `Some(entries)` for a whole record at `pos`, `None` otherwise.
fn decode(block: &[u8], pos: u64) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    if &block[0..4] != MAGIC {
        return None;
    }
    let crc = u32::from_le_bytes(block[4..8].try_into().ok()?);
    // The CRC covers the block with its own field as zeroes (no copy of the block needed).
    let sum = crc32c::crc32c_append(
        crc32c::crc32c_append(crc32c::crc32c(&block[..4]), &[0; 4]),
        &block[8..],
    );
    if sum != crc || u64::from_le_bytes(block[8..16].try_into().ok()?) != pos {
        return None;
    }
    let count = u16::from_le_bytes(block[16..18].try_into().ok()?);
    let used = u32::from_le_bytes(block[20..24].try_into().ok()?) as usize;
    let body = block.get(HEADER..HEADER + used)?;
    let mut out = Vec::with_capacity(usize::from(count));
    let mut at = 0;
    for _ in 0..count {
        let kl = usize::from(u16::from_le_bytes(body.get(at..at + 2)?.try_into().ok()?));
        let vl = usize::from(u16::from_le_bytes(
            body.get(at + 2..at + 4)?.try_into().ok()?,
        ));
        at += 4;
        let k = body.get(at..at + kl)?.to_vec();
        at += kl;
        let v = body.get(at..at + vl)?.to_vec();
        at += vl;
        out.push((k, v));
    }
    (at == used).then_some(out)
}

impl<Q: QueuePair> Wal<Q> {
    /// Forgets the log on namespace `ns` of `q`: zeroes its first record and flushes, so that the next
    /// [`recover`](Self::recover) finds an empty log (the records after it are left, unread). For benchmarks
    /// that start each run from nothing.
    pub async fn erase(q: &AsyncQueue<Q>, pool: &DmaPool, ns: &Namespace) -> Result<(), WalError> {
        let bs = ns.block_size;
        if bs == 0 || bs as usize > BLOCK || BLOCK % bs as usize != 0 {
            return Err(WalError::BlockSize(bs));
        }
        let mut buf = pool.alloc(BLOCK)?;
        buf.as_mut_slice()[..BLOCK].fill(0);
        let lbas = (BLOCK / bs as usize) as u32;
        q.write(ns.nsid, 0, lbas, buf).await.result?;
        q.flush(ns.nsid).await.result?;
        Ok(())
    }

    /// Opens the log on namespace `ns` of `q`: reads its records from the start until one is not whole, and
    /// goes on from there. Buffers come from `pool` (4 KiB ones).
    pub async fn recover(
        q: AsyncQueue<Q>,
        pool: DmaPool,
        ns: &Namespace,
    ) -> Result<(Wal<Q>, Recovered), WalError> {
        let bs = ns.block_size;
        if bs == 0 || bs as usize > BLOCK || BLOCK % bs as usize != 0 {
            return Err(WalError::BlockSize(bs));
        }
        let lbas = (BLOCK / bs as usize) as u32;
        let capacity = ns.blocks / u64::from(lbas);
        let mut rec = Recovered::default();
        let mut pos = 0;
        while pos < capacity {
            let c = q
                .read(ns.nsid, pos * u64::from(lbas), lbas, pool.alloc(BLOCK)?)
                .await;
            c.result?;
            let buf = c.buf.expect("a read hands its buffer back");
            match decode(&buf.as_slice()[..BLOCK], pos) {
                Some(entries) => {
                    rec.entries.extend(entries);
                    rec.records += 1;
                    pos += 1;
                }
                None => {
                    rec.torn_tail = buf.as_slice()[..BLOCK].iter().any(|&b| b != 0);
                    break;
                }
            }
        }
        let wal = Wal {
            inner: Rc::new(Inner {
                q,
                pool,
                nsid: ns.nsid,
                lbas,
                capacity,
                st: RefCell::new(State {
                    next_pos: pos,
                    pending: VecDeque::new(),
                    next_seq: 0,
                    durable: 0,
                    waiters: Vec::new(),
                    committer: None,
                    failed: None,
                    closing: false,
                    records: 0,
                    entries: 0,
                }),
            }),
        };
        Ok((wal, rec))
    }

    /// Appends (key, value) and resolves once the record that carries it is durable (group commit: the
    /// committer writes as many waiting entries as fit one record at a time). Needs [`run_committer`]
    /// running on the same executor.
    ///
    /// [`run_committer`]: Self::run_committer
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), WalError> {
        let len = 4 + key.len() + value.len();
        if len > PAYLOAD || key.len() > usize::from(u16::MAX) || value.len() > usize::from(u16::MAX)
        {
            return Err(WalError::TooBig { len });
        }
        let seq = {
            let mut st = self.inner.st.borrow_mut();
            if let Some(why) = &st.failed {
                return Err(WalError::Failed(why.clone()));
            }
            let seq = st.next_seq;
            st.next_seq += 1;
            st.pending.push_back((seq, key.to_vec(), value.to_vec()));
            if let Some(w) = st.committer.take() {
                w.wake();
            }
            seq
        };
        poll_fn(|cx| {
            let mut st = self.inner.st.borrow_mut();
            if st.durable > seq {
                return Poll::Ready(Ok(()));
            }
            if let Some(why) = &st.failed {
                return Poll::Ready(Err(WalError::Failed(why.clone())));
            }
            st.waiters.push((seq, cx.waker().clone()));
            Poll::Pending
        })
        .await
    }

    /// The committer: writes waiting entries, a record at a time, flushes, and acknowledges them; returns
    /// when [`close`](Self::close) was called and nothing waits, or with the error that failed the log.
    pub async fn run_committer(&self) -> Result<(), WalError> {
        let inner = &self.inner;
        loop {
            let more = poll_fn(|cx| {
                let mut st = inner.st.borrow_mut();
                if !st.pending.is_empty() {
                    return Poll::Ready(true);
                }
                if st.closing {
                    return Poll::Ready(false);
                }
                st.committer = Some(cx.waker().clone());
                Poll::Pending
            })
            .await;
            if !more {
                return Ok(());
            }
            if let Err(e) = self.commit_one().await {
                let mut st = inner.st.borrow_mut();
                st.failed = Some(e.to_string());
                for (_, w) in st.waiters.drain(..) {
                    w.wake();
                }
                return Err(e);
            }
        }
    }

    /// Writes one record of waiting entries, flushes, and wakes the writers it carried.
    async fn commit_one(&self) -> Result<(), WalError> {
        let inner = &self.inner;
        let (pos, batch) = {
            let mut st = inner.st.borrow_mut();
            if st.next_pos >= inner.capacity {
                return Err(WalError::Full(inner.capacity));
            }
            let mut used = 0;
            let mut batch = Vec::new();
            while let Some((_, k, v)) = st.pending.front() {
                let len = 4 + k.len() + v.len();
                if used + len > PAYLOAD {
                    break;
                }
                used += len;
                batch.push(st.pending.pop_front().expect("front exists"));
            }
            (st.next_pos, batch)
        };
        let mut buf = inner.pool.alloc(BLOCK)?;
        encode(&mut buf.as_mut_slice()[..BLOCK], pos, &batch);
        let lba = pos * u64::from(inner.lbas);
        inner
            .q
            .write(inner.nsid, lba, inner.lbas, buf)
            .await
            .result?;
        inner.q.flush(inner.nsid).await.result?;
        let mut st = inner.st.borrow_mut();
        st.next_pos = pos + 1;
        st.records += 1;
        st.entries += batch.len() as u64;
        st.durable = batch.last().map_or(st.durable, |(seq, _, _)| seq + 1);
        let durable = st.durable;
        st.waiters.retain(|(seq, w)| {
            if *seq < durable {
                w.wake_by_ref();
                false
            } else {
                true
            }
        });
        Ok(())
    }

    /// Lets the committer end once every waiting entry is written.
    pub fn close(&self) {
        let mut st = self.inner.st.borrow_mut();
        st.closing = true;
        if let Some(w) = st.committer.take() {
            w.wake();
        }
    }

    /// Records written and entries acknowledged since the log was opened.
    pub fn counts(&self) -> (u64, u64) {
        let st = self.inner.st.borrow();
        (st.records, st.entries)
    }

    /// The next record's position.
    pub fn end(&self) -> u64 {
        self.inner.st.borrow().next_pos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_any_damage_is_seen() {
        let entries: Vec<_> = (0..50u64)
            .map(|i| (i, format!("key-{i}").into_bytes(), vec![i as u8; 40]))
            .collect();
        let mut block = vec![0u8; BLOCK];
        encode(&mut block, 7, &entries);
        let back = decode(&block, 7).expect("whole");
        assert_eq!(back.len(), 50);
        assert_eq!(back[3], (b"key-3".to_vec(), vec![3u8; 40]));
        assert!(decode(&block, 8).is_none(), "another position");
        for at in [0, 5, 9, 17, 21, 40, 2000, BLOCK - 1] {
            let mut torn = block.clone();
            torn[at] ^= 0x40;
            assert!(decode(&torn, 7).is_none(), "a flipped bit at {at} passed");
        }
        // A write torn at a sector boundary: the second half is still the old (zero) content.
        let mut torn = block.clone();
        torn[2048..].fill(0);
        assert!(decode(&torn, 7).is_none());
        assert!(decode(&vec![0u8; BLOCK], 0).is_none());
    }
}
