"""The chaos suite: every backend under faults, kill storms and 200 waiters (issue #7)."""
