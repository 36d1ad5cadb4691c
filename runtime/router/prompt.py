"""Request body -> the prompt token ids the replica's engine will see, for prefix matching.

Uses the model's own tokenizer and the server's own request models and chat-template rule, so the router
hashes the same tokens the engine caches: completions tokenise `prompt` with special tokens; chat renders
`messages` with the model's chat template (or kvserve's fallback) and tokenises without adding special
tokens, exactly as kvserve.runtime.server.serving does. A body the server would reject yields None: the
router then routes on load alone and the replica returns the proper 400.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from kvserve.runtime.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("kvserve.router")


class PromptTokenizer:
    def __init__(self, model_dir: str):
        from kvserve.runtime.tokenizer import chat_template, load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        self.chat_template = chat_template(self.tokenizer)

    def token_ids(self, path: str, body: Any) -> list[int] | None:
        """Blocking (tokeniser work): call it off the event loop."""
        try:
            if path.endswith("/chat/completions"):
                chat = ChatCompletionRequest.model_validate(body)
                conversation = [{"role": m.role, "content": m.text()} for m in chat.messages]
                text = self.tokenizer.apply_chat_template(
                    conversation,
                    chat_template=self.chat_template,
                    tokenize=False,
                    add_generation_prompt=chat.add_generation_prompt,
                )
                return list(self.tokenizer.encode(text, add_special_tokens=False))
            prompt = CompletionRequest.model_validate(body).prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                prompt = prompt[0]  # a batch: route by its first prompt
            elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return list(self.tokenizer.encode(prompt, add_special_tokens=True))
            return [int(t) for t in prompt]
        except (ValidationError, ValueError, TypeError, KeyError) as exc:
            logger.debug("cannot tokenise the request for prefix matching (%s); routing on load", exc)
            return None
        except Exception as exc:  # noqa: BLE001 -- chat templates raise jinja errors of many kinds
            logger.debug("chat template failed (%s); routing on load", exc)
            return None
