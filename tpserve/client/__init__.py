"""The client side of the daemon: the client library (client.py), the wire protocol's executable
form (protocol.py), where a daemon listens (addresses.py) and CurveZMQ key files (keys.py).

Importing this package loads no engine, and nothing in it imports the server: clients and the
CLI stay light.
"""
from tpserve.client.client import AsyncClient, Client, ClientTimeout, Delta, GenerateResult, RequestError
from tpserve.client.protocol import PROTOCOL_VERSION, ProtocolError

__all__ = ["AsyncClient", "Client", "ClientTimeout", "Delta", "GenerateResult", "RequestError",
           "ProtocolError", "PROTOCOL_VERSION"]
