//! The target's configuration file (being written).
