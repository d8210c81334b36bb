"""lockrun's tests: run them with scripts/check (CONTRIBUTING.md)."""
