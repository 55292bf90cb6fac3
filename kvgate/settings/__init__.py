"""Sections of the gateway settings that fronts enforce, kept here so kvgate/config.py imports no front."""
