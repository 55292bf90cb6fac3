"""Pure routing logic: hashing, policies, decisions. Nothing in this package does I/O."""
