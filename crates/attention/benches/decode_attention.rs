//! Decode-attention bandwidth bench (placeholder until the bench lands).

fn main() {}
