"""lockrun's benchmarks: `python -m bench` (targets and verdicts), `python -m bench.report`.

Run them from the repository root: they start the tests' throwaway servers
(tests/support/servers.py). docs/benchmarks.md says what they measure.
"""
