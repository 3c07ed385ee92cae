//! The rstream tunnel protocol (under construction).
