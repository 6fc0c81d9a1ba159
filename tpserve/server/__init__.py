"""The daemon's server: one Engine behind a ZMQ ROUTER socket.

server.py runs the serving loop, made of listener.py (the bound socket and its poller),
connections.py (which routing ids a closed connection carried), outbox.py (per-peer send queues),
fair_queue.py (requests held in front of the engine, per connection), tokenizing.py (long prompts
tokenized off the loop), profiling.py, metrics.py and kv_events.py; daemon.py is the life cycle
around it (runtime dir, fronts, workers) and runtime.py the runtime directory's files.
"""
