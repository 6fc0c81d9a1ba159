"""The client side of the daemon: the client library (client.py), the wire protocol's executable
form (protocol.py), where a daemon listens (addresses.py) and CurveZMQ key files (keys.py).

Importing this package loads no engine, and nothing in it imports the server: clients and the
CLI stay light. Its names are imported on first use, so that a module that needs only
addresses.py (`tpserve stop`) does not load zmq, msgpack or numpy either.
"""
__all__ = ["AsyncClient", "Client", "ClientTimeout", "Delta", "GenerateResult", "PoolingResult",
           "RequestError", "ProtocolError", "PROTOCOL_VERSION"]

_FROM_CLIENT = ("AsyncClient", "Client", "ClientTimeout", "Delta", "GenerateResult", "PoolingResult",
                "RequestError")
_FROM_PROTOCOL = ("ProtocolError", "PROTOCOL_VERSION")


def __getattr__(name):
    if name in _FROM_CLIENT:
        from tpserve.client import client
        return getattr(client, name)
    if name in _FROM_PROTOCOL:
        from tpserve.client import protocol
        return getattr(protocol, name)
    raise AttributeError(f"module 'tpserve.client' has no attribute {name!r}")
