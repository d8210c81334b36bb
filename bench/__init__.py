"""lockrun's benchmarks: ``python -m bench`` (targets, verdicts), ``python -m bench.report``."""
