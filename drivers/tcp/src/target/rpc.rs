//! The target's control socket (being written).
