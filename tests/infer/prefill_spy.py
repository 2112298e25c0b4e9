"""Record the engine's prefill forwards as its runner gets them (tests only)."""


def spy_prefills(engine, record) -> None:
    """Wrap engine.runner.prefill: record(start, end) for each forward (ints, or per-row lists), then run it."""
    real = engine.runner.prefill

    def prefill(seqs, start, end, *snapshots):
        record(start, end)
        return real(seqs, start, end, *snapshots)

    engine.runner.prefill = prefill
