"""The daemon: click CLI (cli.py), ZMQ front (server.py and the modules it is made of:
listener.py, outbox.py, tokenizing.py, profiling.py), wire protocol (protocol.py), client library
(client.py), life cycle (daemon.py), runtime dir (runtime.py), CurveZMQ keys (keys.py).

Importing this package loads no engine: clients and the CLI stay light.
"""
from tpserve.daemon.client import AsyncClient, Client, ClientTimeout, Delta, GenerateResult, RequestError
from tpserve.daemon.protocol import PROTOCOL_VERSION, ProtocolError

__all__ = ["AsyncClient", "Client", "ClientTimeout", "Delta", "GenerateResult", "RequestError",
           "ProtocolError", "PROTOCOL_VERSION"]
