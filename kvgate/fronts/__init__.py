"""Front doors of other protocols over the one chat pipeline (kvgate/gateway/front.py)."""
