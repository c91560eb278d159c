"""The sandbox backends, a module each (base.py: what one is and the registry)."""
