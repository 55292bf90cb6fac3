"""The HTTP fuzz's parts (tests/test_fuzz.py): the fleet, the strategies, the wire, the checks."""
