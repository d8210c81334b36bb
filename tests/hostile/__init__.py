"""The adversarial suite: what a careless operator types and a co-tenant plants (issue #8)."""
