"""Grammar compilation, done at the edge (the HTTP handler's thread pool, or `LLM.generate`'s validation pass),
never inside an engine step: a request reaches the engine only with its grammar compiled, so a slow schema
delays that request alone. Compiled grammars are cached by spec (xgrammar caches too).

A compiled grammar crosses process boundaries (tensor-parallel workers, an engine-core process) as
xgrammar's JSON serialisation plus the tokenizer it was compiled for; the receiving process rebuilds the
tokenizer info once per model (`CompiledConstraint.__reduce__`)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.structured_output.schema_bounds import DEFAULT_MAX_NUMBER_DIGITS, prepare_schema
from kvserve.runtime.structured_output.spec import StructuredOutputSpec

CACHE_ENTRIES = 512
_TOKENIZER_INFOS: dict[tuple, Any] = {}  # (model_dir, vocab_size, stop ids) -> xgrammar.TokenizerInfo
_LOCK = threading.Lock()


def tokenizer_info(model_key: tuple, tokenizer: Any = None):
    """The xgrammar TokenizerInfo for a model, built once per process."""
    import xgrammar as xgr

    with _LOCK:
        info = _TOKENIZER_INFOS.get(model_key)
        if info is None:
            model_dir, vocab_size, stop_ids = model_key
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
            _TOKENIZER_INFOS[model_key] = info
        return info


def _restore(grammar_json: str, model_key: tuple) -> "CompiledConstraint":
    import xgrammar as xgr

    return CompiledConstraint(xgr.CompiledGrammar.deserialize_json(grammar_json, tokenizer_info(model_key)), model_key)


class CompiledConstraint:
    """A compiled grammar for one model; what SamplingParams carries into the engine."""

    __slots__ = ("grammar", "model_key")

    def __init__(self, grammar: Any, model_key: tuple):
        self.grammar, self.model_key = grammar, model_key

    def __reduce__(self):
        return _restore, (self.grammar.serialize_json(), self.model_key)


class GrammarCompiler:
    """Compiles StructuredOutputSpecs for one model (tokenizer + vocab size + stop token ids)."""

    def __init__(
        self,
        tokenizer: Any,
        model_dir: str,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        max_number_digits: int = DEFAULT_MAX_NUMBER_DIGITS,
    ):
        import xgrammar as xgr

        self.model_key = (model_dir, int(vocab_size), tuple(sorted(stop_token_ids)))
        self.compiler = xgr.GrammarCompiler(tokenizer_info(self.model_key, tokenizer), max_threads=1)
        self._cache: OrderedDict[str, CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()
        self.max_number_digits = max_number_digits

    @classmethod
    def for_engine(cls, tokenizer: Any, config: Any) -> GrammarCompiler:
        """The compiler for an engine's model and settings (EngineConfig): the offline engine's and the API
        server's are built the same way."""
        m = config.model
        return cls(tokenizer, m.model_dir, m.vocab_size, m.eos_token_ids, config.structured_output_max_number_digits)

    def compile(self, spec: StructuredOutputSpec) -> CompiledConstraint:
        """Raises InvalidParameter naming the request field when the schema/regex/grammar is invalid."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit
        try:
            grammar = self._compile(spec)
        except InvalidParameter:
            raise
        except Exception as exc:  # noqa: BLE001 -- xgrammar raises RuntimeError/ValueError with its parser's text
            text = " ".join(str(exc).split())[:500]
            raise InvalidParameter(spec.field, f"{spec.field}: cannot compile the {spec.kind}: {text}") from None
        compiled = CompiledConstraint(grammar, self.model_key)
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputSpec):
        c = self.compiler
        if spec.kind == "json_object":  # OpenAI's JSON mode: an object (the builtin JSON grammar allows any value)
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json":
            # Unbounded numbers get a digit bound and keywords xgrammar would drop are 400s (schema_bounds.py).
            schema = prepare_schema(json.loads(spec.value), spec.field, self.max_number_digits)
            return c.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            # One EBNF alternative per choice; json.dumps gives the escaped string literal EBNF reads.
            alternatives = " | ".join(json.dumps(choice) for choice in json.loads(spec.value))
            return c.compile_grammar(f"root ::= {alternatives}")
        return c.compile_grammar(spec.value)
