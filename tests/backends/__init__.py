"""What one backend does that the others do not (Sentinel, TLS, option files, poolers…)."""
