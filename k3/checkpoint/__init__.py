"""Checkpoints: native save/load and Hugging Face format import/export (Kimi-Linear, Kimi-K3)."""
