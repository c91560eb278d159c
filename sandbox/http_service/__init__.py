"""The sandbox as an HTTP service (`python -m sandbox serve`, api.py): its request guards
(guards.py), its Prometheus metrics (metrics.py) and the client HTTPSandbox (client.py)."""
