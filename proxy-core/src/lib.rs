//! TCP relaying for Kubernetes networking (under construction).
