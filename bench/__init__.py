"""maintd's benchmarks: `python -m bench [NAME ...] [--quick]` (see docs/PERFORMANCE.md)."""
