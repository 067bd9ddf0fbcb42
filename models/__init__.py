"""Reference models for kvram's examples and benchmarks (not part of the installed package)."""
