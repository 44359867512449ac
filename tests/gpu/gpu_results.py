"""What the GPU tests measured, for tests/gpu/conftest.py's end-of-run table: (plan, ranks, verify line, wall s)."""

RESULTS: list[tuple[str, int, str, float]] = []
