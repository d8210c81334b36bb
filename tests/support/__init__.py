"""What the tests (and bench/) share: servers, proxies, oracles, other users, lockrun runs.

No test module imports another; each imports from here.
"""
