"""lockrun's benchmarks: ``python -m bench`` (targets, verdicts), ``python -m bench.report``.

Run them from the repository root: they start the tests' throwaway servers.
"""
