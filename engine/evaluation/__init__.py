"""Quality evaluation of engine configurations (``pdserve eval``): corpus.py (offline text,
pinned by a hash, tune / held-out parts), metrics.py, run.py."""
