"""The wire both sides speak: the message protocol (protocol.py) and the CurveZMQ helpers
(security.py). It imports nothing of routing or workers, so the router, its clients and the
workers all depend on it and not on each other."""
