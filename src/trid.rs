//! Transport IDs (stub).
