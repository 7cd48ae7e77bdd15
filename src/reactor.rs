//! Reactors (stub; the foundation issue fills this in).
