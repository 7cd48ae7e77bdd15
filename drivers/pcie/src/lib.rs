//! NVMe over PCIe through VFIO (see issue 7). Not implemented yet.
#![deny(missing_docs)]
