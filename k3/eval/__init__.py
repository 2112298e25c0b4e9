"""Long-context evaluation (synthetic tasks at any length, loss by position) and matched ablations."""
