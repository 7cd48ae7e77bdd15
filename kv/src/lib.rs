//! An example storage engine written only against nvpoll's public API, as an embedder would write one: a
//! write-ahead log with group commit ([`wal`]) and a small key-value store over it ([`Kv`]), driven through
//! the async interface (`nvpoll::aio`) on one thread.
//!
//! - **The log** is a run of 4 KiB blocks from LBA 0 of a namespace. Each block is a record: a header (magic,
//!   its position, the entry count, the bytes used, a CRC32C over the block) and the entries (key, value).
//!   One block is in flight at a time, so only the last block of the log can be torn; recovery reads blocks in
//!   order while each is whole (magic, position, CRC) and stops at the first that is not.
//! - **Group commit:** writers append entries and wait; the committer takes as many as fit in a block, writes
//!   it, flushes the namespace's write cache, and then wakes every writer whose entry that block carried. An
//!   entry is acknowledged only once its block is durable, and blocks become durable in order.
//! - **The store** is the log replayed into memory: a value is returned only from a whole record.
#![forbid(unsafe_code)]

pub mod file;
pub mod wal;

use std::collections::HashMap;

pub use wal::{Recovered, Wal, WalError};

/// A key-value store over a [`Wal`]: puts go through the log (group commit), gets come from memory.
pub struct Kv {
    map: HashMap<Vec<u8>, Vec<u8>>,
}

impl Kv {
    /// The store the recovered log describes.
    pub fn from_recovered(r: &Recovered) -> Kv {
        let mut map = HashMap::new();
        for (k, v) in &r.entries {
            map.insert(k.clone(), v.clone());
        }
        Kv { map }
    }

    /// Records a put that the log acknowledged.
    pub fn apply(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.map.insert(key, value);
    }

    /// The value of `key`.
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.map.get(key).map(Vec::as_slice)
    }

    /// How many keys.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Every key and value.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.map.iter().map(|(k, v)| (k.as_slice(), v.as_slice()))
    }
}
