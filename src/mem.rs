//! Pinned DMA memory (stub; the foundation issue fills this in).
#![allow(missing_docs)]

/// A buffer of DMA memory.
#[derive(Debug)]
pub struct DmaBuf {
    data: Vec<u8>,
}

impl DmaBuf {
    pub fn len(&self) -> usize {
        self.data.len()
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    pub fn as_slice(&self) -> &[u8] {
        &self.data
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.data
    }
}
