"""The session controller and what it decides on: pure, no I/O."""
