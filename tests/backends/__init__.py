"""What only one backend does: the scenarios no other backend shares."""
