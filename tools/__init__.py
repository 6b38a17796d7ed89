"""Lab tools (probes and harnesses) and the multi-rank helpers they share with tests/: a package
so that spawned ranks and writers can import their functions by name from the repository root."""
