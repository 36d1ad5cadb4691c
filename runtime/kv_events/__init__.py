"""KV cache events in vLLM's wire format: the config (`--kv-events-config`), the event types, the ZMQ
publisher the engine core feeds once per step, and the decoder the router reads any vLLM-format stream with.
"""
