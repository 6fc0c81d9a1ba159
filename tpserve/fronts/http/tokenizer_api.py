"""vLLM's tokenizer endpoints on the HTTP front (clients such as lm-eval and vLLM's benchmark
probe them): the front's own tokenizer, the same one its completions use.

* ``POST /tokenize``: ``{"prompt": text, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
  "tools", "add_special_tokens": false}``, plus ``"return_token_strs"`` -> ``{"count", "max_model_len",
  "tokens", "token_strs"}``.
* ``POST /detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": text}``.
* ``GET /tokenizer_info``: the tokenizer's class, vocabulary size, special tokens and chat
  template.

Errors are OpenAI error bodies naming the field, as on ``/v1``.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from tpserve import limits as R
from tpserve.errors import InvalidFieldError
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http.tool_calls import parse_tools


def make_tokenizer_router(front, authorize, read_json) -> APIRouter:
    router = APIRouter(dependencies=[Depends(authorize)])

    def tokenizer():
        if front.tokenizer is None:
            raise O.OpenAIError(400, "this model has no tokenizer", code="tokenizer_missing")
        return front.tokenizer

    async def read_body(request: Request) -> dict:
        """The JSON object of the request, for the served model (400 / 404 otherwise)."""
        body = await read_json(request)
        if not isinstance(body, dict):
            raise O.bad(None, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != front.model_name:
            raise O.OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                                     f"`{front.model_name}`.", "model", code="model_not_found")
        return body

    @router.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request)
        tokenizer()
        strs = O._bool(body, "return_token_strs", False)
        if "messages" in body:
            job = O.parse_chat({"messages": body["messages"], **{k: body[k] for k in O._CHAT_OPTIONS if k in body}},
                               front.model_name)
            plan = parse_tools(body)  # vLLM's tokenize renders the tools too
            ids = await front.chat_prompt(job.messages, job.chat_options, O._bool(body, "add_special_tokens", False),
                                          tools=plan.tools if plan is not None else None)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise O.bad("prompt", "must be a non-empty string (or send messages)",
                            code="missing_required_parameter" if prompt is None else "invalid_value")
            ids = await front.encode(prompt, O._bool(body, "add_special_tokens", True))
        return {"count": len(ids), "max_model_len": front.max_model_len, "tokens": ids,
                "token_strs": tokenizer().convert_ids_to_tokens(ids) if strs else None}

    @router.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request)
        tok = tokenizer()
        try:
            ids = R.check_token_ids("tokens", body.get("tokens"), R.MAX_PROMPT_TOKENS, 0, len(tok))
        except InvalidFieldError as e:
            raise O.bad(e.field, e.reason) from None
        return {"prompt": await front.decode(ids)}

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        tok = tokenizer()
        info = {"tokenizer_class": type(tok).__name__, "vocab_size": len(tok),
                "model_max_length": front.max_model_len,
                "chat_template": getattr(tok, "chat_template", None)}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            info[name] = getattr(tok, name, None)
        return info

    return router
