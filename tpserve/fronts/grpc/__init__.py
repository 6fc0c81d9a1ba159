"""The gRPC front: vLLM's gRPC engine service for smg, with its KV-cache event stream."""
