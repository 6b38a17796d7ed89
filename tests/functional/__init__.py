"""The functional tier: multi-rank gloo runs (multirank/) and end-to-end runs of the scripts,
examples, recipes and benchmarks (e2e/)."""
