"""vLLM's /tokenize and /detokenize, with vLLM's request and response shapes.

/tokenize takes a completion-style body (`prompt`) or a chat-style one (`messages`, rendered by
the same template code as /v1/chat/completions, so the ids are the ones a chat request runs).
"""

from __future__ import annotations

from typing import Any

from specserve.sampling_params import InvalidRequestError
from specserve.server.compat import check_chat_body
from specserve.server.errors import bad_request
from specserve.server.prepare import invalid
from specserve.server.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from specserve.server.responses import DetokenizeResponse, TokenizeResponse
from specserve.server.serving import OpenAIServing
from specserve.server.validation import validate_body


async def tokenize(serving: OpenAIServing, data: dict[str, Any]) -> TokenizeResponse:
    if "messages" in data:
        check_chat_body(data)
        chat = validate_body(TokenizeChatRequest, data)
        chat.check()
        serving.check_model(chat.model)
        _, ids = await serving.chat_prompt(chat)
        want_strs = chat.return_token_strs
    else:
        req = validate_body(TokenizeCompletionRequest, data)
        serving.check_model(req.model)
        ids = await serving.encode(req.prompt, req.add_special_tokens, "prompt")
        want_strs = req.return_token_strs
    strs = None
    if want_strs:
        strs = await serving.lanes.run(len(ids), lambda t: list(t.convert_ids_to_tokens(ids)))
    return TokenizeResponse(
        count=len(ids), max_model_len=serving.client.max_model_len, tokens=ids, token_strs=strs
    )


async def detokenize(serving: OpenAIServing, data: dict[str, Any]) -> DetokenizeResponse:
    req = validate_body(DetokenizeRequest, data)
    serving.check_model(req.model)
    if serving.client.tokenizer is None:
        raise bad_request("this model has no tokenizer", "tokens")
    serving.check_token_ids(req.tokens, "tokens")
    try:
        serving.lanes.check_size(len(req.tokens), "tokens")
    except InvalidRequestError as e:
        raise invalid(e) from None
    return DetokenizeResponse(prompt=await serving.lanes.decode(req.tokens))
