"""Per-request output state: text (incremental detokenisation, runtime/tokenizer.py), stop strings, logprobs,
and the merge of an n > 1 request's children (engine/parent_request.py) into one output, a choice per child."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvserve.runtime.core.outputs import EngineCoreOutput, TokenLogprobs
from kvserve.runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.runtime.sampling_params import SamplingParams
from kvserve.runtime.tokenizer import detokenize_incremental, fast_decode


@dataclass
class SampleState:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # text released so far (never shrinks)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Incremental detokenisation (vLLM's scheme): the text of token_ids[:read_offset] is in decoded_text;
    # token_ids[prefix_offset:read_offset] is re-decoded as context so word-boundary spaces come out right.
    decoded_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0


class RequestState:
    """One user request: samples[i] is choice i, the output of the core's request child_ids[i]."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
        arrival_time: float,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.child_ids = child_ids
        self.samples = [
            SampleState(i, logprobs=[] if params.logprobs is not None else None) for i in range(len(child_ids))
        ]
        self.metrics = RequestMetrics(arrival_time)
        self.kv_transfer_params: dict | None = None  # P/D: set by the first sample's final delta

    def unfinished_child_ids(self) -> list[str]:
        return [cid for cid, s in zip(self.child_ids, self.samples) if s.finish_reason is None]

    @property
    def finished(self) -> bool:
        # A plain loop, not all(<genexpr>): this runs for every request on every step in the API server.
        for s in self.samples:
            if s.finish_reason is None:
                return False
        return True

    def to_output(self) -> RequestOutput:
        outs = [
            CompletionOutput(
                s.index,
                s.text,
                list(s.token_ids),
                s.finish_reason,
                s.stop_reason,
                None if s.logprobs is None else list(s.logprobs),
                s.cumulative_logprob if s.logprobs is not None else None,
            )
            for s in self.samples
        ]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outs,
            self.finished,
            RequestMetrics(**vars(self.metrics)),
            kv_transfer_params=self.kv_transfer_params,
        )


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode_ids = fast_decode(tokenizer)
        self._token_text: dict[int, str] = {}

    def process(self, state: RequestState, index: int, out: EngineCoreOutput) -> str | None:
        """Apply one step's new tokens to sample `index`. Returns the stop string if the sample just hit
        one (the caller must then finish it in the scheduler)."""
        sample, params = state.samples[index], state.params
        now = time.monotonic()
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        state.metrics.last_token_time = now
        sample.token_ids.extend(out.new_token_ids)
        if sample.logprobs is not None and out.new_logprobs:
            for lp in out.new_logprobs:
                sample.logprobs.append(self._logprob_dict(lp))
                sample.cumulative_logprob += lp.logprob
        full_text = self._detokenize(sample, params.skip_special_tokens, final=out.finish_reason is not None)
        hit = self._find_stop(full_text, len(sample.text), params) if params.stop_strings else None
        if hit is not None:
            stop, cut = hit
            sample.text = full_text[:cut]
            sample.finish_reason, sample.stop_reason = "stop", stop
            return stop
        if out.finish_reason is not None:
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            sample.text = full_text
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        else:
            # Hold back what might still turn into a stop string, and an incomplete UTF-8 tail.
            hold = max((len(s) for s in params.stop_strings), default=1) - 1
            visible = full_text[: len(full_text) - hold] if hold else full_text
            visible = visible.rstrip("\ufffd")
            if len(visible) > len(sample.text) and visible.startswith(sample.text):
                sample.text = visible
        return None

    def _detokenize(self, sample: SampleState, skip_special_tokens: bool, final: bool) -> str:
        return detokenize_incremental(self._decode_ids, sample, skip_special_tokens, final)

    def finish(self, state: RequestState, index: int, reason: str) -> None:
        sample = state.samples[index]
        if sample.finish_reason is None:
            sample.finish_reason = reason

    @staticmethod
    def _find_stop(text: str, released_len: int, params: SamplingParams) -> tuple[str, int] | None:
        longest = max(len(s) for s in params.stop_strings)
        start = max(0, released_len - longest + 1)
        best = None
        for stop in params.stop_strings:
            idx = text.find(stop, start)
            if idx != -1 and (best is None or idx < best[1]):
                best = (stop, idx)
        if best is None:
            return None
        stop, idx = best
        return stop, idx + (len(stop) if params.include_stop_str_in_output else 0)

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, self._decode_token(lp.token_id))}
        for rank, (tid, value) in enumerate(lp.top, start=1):
            entry.setdefault(tid, Logprob(value, rank, self._decode_token(tid)))
        return entry

    def _decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text
