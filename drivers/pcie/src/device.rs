//! What the driver needs of an NVMe PCI function, whatever backs it (VFIO, or the test stand-in).

use nvpoll::mem::DmaPool;

use crate::error::Error;

/// What the driver needs from an NVMe PCI function: its BAR0 registers and DMA mapping.
///
/// Registers are accessed 32 bits at a time at 4-byte aligned offsets; a 64-bit register is read as two
/// halves, low dword first ([`Device::read64`]).
pub trait Device: Send + Sync + 'static {
    /// Reads the 32-bit register at byte `offset` of BAR0.
    fn read32(&self, offset: usize) -> u32;

    /// Writes the 32-bit register at byte `offset` of BAR0.
    fn write32(&self, offset: usize, value: u32);

    /// Reads a 64-bit register as two 32-bit reads, low dword first.
    fn read64(&self, offset: usize) -> u64 {
        let lo = self.read32(offset);
        let hi = self.read32(offset + 4);
        u64::from(lo) | u64::from(hi) << 32
    }

    /// Writes a 64-bit register as two 32-bit writes, low dword first.
    fn write64(&self, offset: usize, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }

    /// Makes every region of `pool` reachable by the device's DMA and sets the pool's IOVAs.
    fn map_dma(&self, pool: &DmaPool) -> Result<(), Error>;

    /// Undoes one [`Device::map_dma`] of `pool`.
    fn unmap_dma(&self, pool: &DmaPool) -> Result<(), Error>;

    /// A short name for messages (the PCI address).
    fn name(&self) -> String;

    /// Whether the function is still there, asked when a register reads as all ones (which a removed device
    /// answers, but also one whose memory decoding is briefly off, as during a function-level reset): true
    /// means a transient, false that the device is gone. Default: true.
    fn is_present(&self) -> bool {
        true
    }

    /// Whether the kernel asks for the device back (a VFIO device request: the function is being removed or
    /// unplugged). Must not block; the controller's health check asks it on every call. Default: never.
    fn release_requested(&self) -> bool {
        false
    }

    /// Enables MSI-X with up to `want` vectors, each signalling an eventfd: returns the eventfds, by vector
    /// (fewer when the function has fewer). Default: the function has no interrupts to give (an empty list).
    fn enable_msix(&self, _want: u16) -> Result<Vec<std::os::fd::OwnedFd>, Error> {
        Ok(Vec::new())
    }

    /// Gives the device back to the kernel: afterwards no access reaches the device (registers read as all
    /// ones and writes are dropped), its DMA mappings are gone ([`Device::unmap_dma`] does nothing,
    /// [`Device::map_dma`] fails with [`Error::Removed`]), and it is closed. Safe to call while other threads
    /// still read and write registers. Default: nothing.
    fn release(&self) {}
}
