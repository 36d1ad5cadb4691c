"""kvserve runtime. `from kvserve.runtime import LLM, SamplingParams` (torch loads on first use of LLM)."""

from kvserve.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from kvserve.runtime.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvserve.runtime.engine.llm_engine import LLMEngine

        return LLMEngine
    if name in ("RequestOutput", "CompletionOutput"):
        from kvserve.runtime import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
