//! The f32 CPU backend (filled in next commits).
