"""Fronts: processes that speak another API to users and are one more ZMQ client of the daemon.

process.py is what every front shares (a child process of the daemon, restarted when it dies,
stopped on every way out); http/ is the OpenAI-compatible HTTP front, grpc/ the gRPC worker
service that smg routes to.
"""
