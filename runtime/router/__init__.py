"""`kvserve router`: cache- and load-aware routing across replicas (docs/router.md).

The scoring core (prefix_index, scoring) is pure and does no I/O, so the HTTP proxy here and a future
Gateway API Inference Extension endpoint picker are two front doors to the same decisions.
"""
