"""``POST /generate``, SGLang's dialect: ``{"text" | "input_ids", "sampling_params", ...}``,
greedy by default; the fields SGLang's own client sends are accepted (``_sglang_fields``,
``_sglang_sampling`` say which are honoured, type-checked and ignored, or neutral only).
Logprobs: SGLang's ``return_logprob`` with ``top_logprobs_num: k`` (``k`` at most
``MAX_LOGPROBS``). See docs/architecture.md §11.
"""

from __future__ import annotations

from typing import Any

from hicache.api_server.validation.common import (
    MAX_CACHE_SALT_LENGTH,
    Extras,
    Fields,
    ModelLimits,
    PreparedRequest,
    RequestError,
    encode_prompt,
    finish_request,
    read_sampling,
)
from hicache.model.sampling_params import MAX_LOGPROBS, shown
from hicache.text import Tokenizer

GENERATE_FIELDS = (
    "text", "input_ids", "sampling_params", "stream", "cache_salt",
    # SGLang's GenerateReqInput (python/sglang/srt/managers/io_struct.py), as its own client sends it
    "rid", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
    "return_text_in_logprobs", "return_hidden_states", "return_routed_experts", "modalities", "image_data",
    "video_data", "audio_data", "input_embeds", "session_params", "session_id", "lora_path", "lora_id",
    "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
    "decode_tp_size", "data_parallel_rank", "routed_dp_rank", "priority", "extra_key", "log_metrics", "no_logs",
    "custom_labels", "conversation_id", "routing_key", "return_cached_tokens_details",
)
GENERATE_SAMPLING = (
    "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
    # SGLang's SamplingParams (python/sglang/srt/sampling/sampling_params.py)
    "sampling_seed", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "stream_interval",
    "min_new_tokens", "n", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "json_schema",
    "regex", "ebnf", "structural_tag", "stop_regex", "logit_bias", "custom_params",
)
MEDIA_FIELDS = ("image_data", "video_data", "audio_data", "input_embeds")
DISAGG_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size")


def _empty(v: Any) -> bool:
    return v in ([], {}, "")


def _sglang_fields(f: Fields) -> None:
    """SGLang's top-level ``/generate`` fields: type-check the ones that cannot change the
    result (ignored, as SGLang ignores them without logprobs), refuse by name the ones this
    server does not implement when they are set."""
    rid = f.data.get("rid")
    if isinstance(rid, list):
        raise f.error("rid", "is a list: batches are not supported (send one request per prompt)")
    f.get_str("rid")
    if f.get_bool("return_logprob"):  # the output's logprobs are honoured, the prompt's are not
        f.neutral("logprob_start_len", lambda v: v == -1, "prompt logprobs are not implemented: only -1")
        f.neutral("token_ids_logprob", _empty, "logprobs of chosen ids are not implemented")
    f.get_int("logprob_start_len")
    f.int_list("token_ids_logprob")
    f.neutral("return_hidden_states", lambda v: v is False, "hidden states are not returned")
    f.neutral("return_routed_experts", lambda v: v is False, "routed experts are not returned")
    modalities = f.data.get("modalities")
    if modalities is not None and not (isinstance(modalities, list)
                                       and all(m is None or isinstance(m, str) for m in modalities)):
        raise f._bad("modalities", "an array of strings")
    for name in MEDIA_FIELDS:
        f.neutral(name, _empty, "only text prompts")
    f.neutral("session_params", _empty, "sessions are not implemented")
    f.get_str("session_id")
    f.neutral("lora_path", lambda v: v == [] or (isinstance(v, list) and all(x is None for x in v)),
              "LoRA adapters are not supported")
    f.neutral("lora_id", lambda v: False, "LoRA adapters are not supported")
    f.neutral("custom_logit_processor", lambda v: False, "custom logit processors are not supported")
    for name in DISAGG_FIELDS:
        f.neutral(name, lambda v: False, "prefill-decode disaggregation is not supported")
    for name in ("data_parallel_rank", "routed_dp_rank"):
        f.neutral(name, lambda v: v == 0, "this server has one data-parallel rank, 0")
        f.get_int(name)
    f.get_int("priority")
    f.get_bool("log_metrics", True)
    f.get_bool("no_logs")
    custom_labels = f.data.get("custom_labels")
    if custom_labels is not None and not isinstance(custom_labels, dict):
        raise f._bad("custom_labels", "an object")
    f.get_str("conversation_id")
    f.get_str("routing_key")
    f.get_bool("return_cached_tokens_details")  # meta_info always has cached_tokens_details


def _sglang_sampling(sp: Fields) -> None:
    """SGLang's sampling fields that this server does not implement: neutral values only."""
    sp.neutral("n", lambda v: v == 1, "only n = 1 on /generate; the OpenAI routes take n")
    sp.neutral("min_new_tokens", lambda v: v == 0, "min_new_tokens is not implemented")
    for name in ("json_schema", "regex", "ebnf", "structural_tag"):
        sp.neutral(name, lambda v: False, "constrained decoding is not implemented")
    sp.neutral("stop_regex", _empty, "stop_regex is not implemented")
    sp.neutral("logit_bias", _empty, "logit_bias is not implemented")
    sp.neutral("custom_params", _empty, "custom_params are not supported")
    sp.neutral("skip_special_tokens", lambda v: v is True, "special tokens are always skipped in the text")
    sp.get_bool("spaces_between_special_tokens", True)  # moot: special tokens are skipped
    sp.get_int("stream_interval")  # how often a stream sends; this server sends every step


def parse_generate(data: dict[str, Any], rid: str, tokenizer: Tokenizer, limits: ModelLimits) -> PreparedRequest:
    """``{"text" | "input_ids", "sampling_params", "stream", "cache_salt"}``; greedy by default.

    Also takes the fields SGLang's ``/generate`` takes (its own benchmark client sends
    ``lora_path: null``, ``return_logprob: false``, ``logprob_start_len: -1`` ...), see
    ``_sglang_fields`` and ``_sglang_sampling``: ``sampling_seed`` is the seed,
    ``no_stop_trim`` keeps the stop string in the text, ``extra_key`` joins ``cache_salt`` in
    separating cached prefixes.
    """
    f = Fields(data, GENERATE_FIELDS)
    if f.has("text") == f.has("input_ids"):
        raise RequestError("give exactly one of text and input_ids", param="text")
    if isinstance(data.get("text"), list) or (isinstance(data.get("input_ids"), list) and data["input_ids"]
                                               and isinstance(data["input_ids"][0], list)):
        raise RequestError("a batch of prompts is not supported (send one request per prompt)",
                           param="text" if f.has("text") else "input_ids")
    _sglang_fields(f)
    text = f.get_str("text")
    input_ids = encode_prompt(tokenizer, text) if text is not None else list(f.int_list("input_ids"))
    sp = Fields(data.get("sampling_params") or {}, GENERATE_SAMPLING, "sampling_params.")
    _sglang_sampling(sp)
    s = read_sampling(sp, "max_new_tokens", default_temperature=0.0)
    top = f.get_int("top_logprobs_num")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise f.error("top_logprobs_num", f"must be an integer in [0, {MAX_LOGPROBS}], got {shown(top)}")
    if f.get_bool("return_logprob"):
        s = s.also(logprobs=top or 0)
    sampling_seed = sp.get_int("sampling_seed")
    if sampling_seed is not None:
        seed = s.sampling.get("seed")
        if seed is not None and seed != sampling_seed:
            raise sp.error("sampling_seed", f"({sampling_seed}) differs from sampling_params.seed ({seed})")
        s = s.also(seed=sampling_seed)
    salt = f.get_str("cache_salt", "", MAX_CACHE_SALT_LENGTH) or ""
    extra_key = f.get_str("extra_key", "", MAX_CACHE_SALT_LENGTH) or ""
    if extra_key:
        salt = f"{salt}\x00extra_key={extra_key}"
    return finish_request(rid, input_ids, s, limits, stop=sp.stop_strings("stop"), stream=f.get_bool("stream"),
                          cache_salt=salt, extras=Extras(keep_stop=sp.get_bool("no_stop_trim"),
                                                          logprob_text=f.get_bool("return_text_in_logprobs"),
                                                          logprobs_field="top_logprobs_num"),
                          field="sampling_params.max_new_tokens", where="sampling_params.",
                          prompt_field="text" if text is not None else "input_ids")
