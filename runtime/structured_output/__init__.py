"""Structured outputs: grammar-constrained decoding with xgrammar (JSON schema, json_object, regex, choice,
EBNF). `spec` is pure Python (request validation); `compiler` compiles at the edge, off the engine's step;
`constraint` is the per-request matcher the sampler masks logits with."""

from kvserve.runtime.structured_output.spec import StructuredOutputSpec

__all__ = ["StructuredOutputSpec"]
