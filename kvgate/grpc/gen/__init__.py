"""Generated from proto/ by kvgate/dev/protos.py: do not edit."""
