"""The sandbox as a Redis job queue: RedisSandbox (client.py) pushes calls, `python -m sandbox
worker` processes (worker.py) serve them, protocol.py is the queue's keys and messages."""
