"""Offline batch API mirroring vLLM's: `LLM(model=DIR, ...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.runtime.engine import sleep_control
from kvserve.runtime.engine.client import PromptInput
from kvserve.runtime.engine.llm_engine import LLMEngine
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.outputs import RequestOutput
from kvserve.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.runtime.engine.beam_search import BeamSearchOutput, BeamSearchParams


class LLM:
    """With tensor_parallel_size=t > 1 the model runs in t worker processes; call shutdown() (or use
    `with LLM(...) as llm:`) to release them -- they are also released when the LLM is garbage-collected
    and at interpreter exit."""

    def __init__(self, model: str, **engine_kwargs):
        self.engine = LLMEngine.from_kwargs(model, **engine_kwargs)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def beam_search(
        self, prompts: PromptInput | Sequence[PromptInput], params: "BeamSearchParams", use_tqdm: bool = False
    ) -> list["BeamSearchOutput"]:
        """Beam search (vLLM's LLM.beam_search): per prompt, the best params.num_return_sequences (default:
        beam width) beams, best first, selected and scored as HF transformers' generate(num_beams=...) does
        (engine/beam_search.py). Every step runs one 1-token request per live beam of every prompt in one
        batch; the beams' shared prefixes are prefix-cache hits."""
        from dataclasses import replace

        from kvserve.runtime.engine.beam_search import (
            BeamSearch,
            advance_all,
            pending_batch,
            to_output,
            top_logprobs,
        )

        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        max_model_len = self.engine.config.model.max_model_len
        eos = frozenset(self.engine.config.model.eos_token_ids)
        ids_list, searches = [], []
        for i, prompt in enumerate(prompts):
            try:
                ids = self.engine.prepare(prompt, SamplingParams(max_tokens=1)).prompt_token_ids
            except InvalidParameter as exc:
                raise InvalidParameter(exc.param, f"prompts[{i}]: {exc}") from None
            # The context bounds the search like any request's max_tokens.
            room = max(1, min(params.max_tokens, max_model_len - len(ids)))
            ids_list.append(ids)
            searches.append(BeamSearch(replace(params, max_tokens=room), eos))
        while batch := pending_batch(searches, ids_list):
            step_params = [
                SamplingParams(max_tokens=1, temperature=0, logprobs=search.num_candidates, ignore_eos=True)
                for search, _ in batch
            ]
            outs = self.generate([{"prompt_token_ids": ids} for _, ids in batch], step_params, use_tqdm=use_tqdm)
            for out in outs:
                if out.error is not None:
                    raise RuntimeError(f"beam search step failed: {out.error}")
            advance_all(batch, [top_logprobs(o.outputs[0].logprobs[0], p.logprobs) for o, p in zip(outs, step_params)])
        decode = lambda tokens: self.tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
        return [to_output(ids, search, decode) for ids, search in zip(ids_list, searches)]

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in input order. All prompts and
        their sampling params are validated before any work starts, so a bad one raises InvalidParameter
        (naming the field and the prompt's index, `prompts[i]: ...`) without leaving half a batch behind.
        A request that fails inside the engine (a server-side error specific to it) fails alone: its
        RequestOutput has finish_reason "error" and `error` set, the other prompts complete normally.
        A dead engine raises (EngineDeadError, or WorkerDiedError naming the rank).
        lora_request: a --lora-modules adapter name for every prompt, or one per prompt (None: the base
        model); it sets each SamplingParams' lora_name."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidParameter(
                    "sampling_params", f"got {len(params_list)} sampling_params for {len(prompts)} prompts"
                )
        if lora_request is not None:
            names = [lora_request] * len(prompts) if isinstance(lora_request, str) else list(lora_request)
            if len(names) != len(prompts):
                raise InvalidParameter("lora_request", f"got {len(names)} lora_request for {len(prompts)} prompts")
            from dataclasses import replace

            params_list = [p if n is None else replace(p, lora_name=n) for p, n in zip(params_list, names)]
        prepared = []
        compiled: dict[int, SamplingParams] = {}  # one compile per distinct params object
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:  # every prompt checked before the first is queued (the front's one verification)
                if id(params) not in compiled:
                    compiled[id(params)] = self.engine.compile_constraint(params)
                prepared.append(self.engine.prepare(prompt, compiled[id(params)]))
            except InvalidParameter as exc:
                raise InvalidParameter(exc.param, f"prompts[{i}]: {exc}") from None

        request_ids = []
        for request in prepared:
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, request)
            request_ids.append(rid)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            # Until these requests are done: a P/D prefill engine keeps stepping while it holds leases
            # (has_unfinished_requests), which generate() need not wait out.
            while len(results) < len(request_ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix(gen_tokens=self.engine.generation_tokens, refresh=False)
        except BaseException:
            for rid in request_ids:  # leave the engine clean (e.g. after Ctrl-C)
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in request_ids]

    # -- sleep mode (vLLM's LLM.sleep / wake_up; needs enable_sleep_mode=True) -------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1: weights kept in host memory; level 2: weights dropped, re-read on wake).
        Between generate() calls; engine/sleep_control.py."""
        sleep_control.run(self.engine.core, "sleep", [level])

    def wake_up(self) -> None:
        sleep_control.run(self.engine.core, "wake_up", [])

    def is_sleeping(self) -> bool:
        return bool(sleep_control.run(self.engine.core, "is_sleeping", [])["is_sleeping"])
