"""Voxtral's audio through the OpenAI chat API (issue 42): the openai SDK sends an ``input_audio`` part
(base64 of a 16 kHz WAV file) to the tiny random Voxtral served in process; the answer is
``transformers``' on that clip (its ``[AUDIO]`` placeholder expanded by ``multimodal_voxtral``), and a
second clip over ``--limit-mm-per-prompt`` is a 400 naming ``messages``."""

from __future__ import annotations

import openai
import pytest

from tests.models.test_qwen2_audio import clip
from tests.models.test_voxtral import AUDIO, MAX_NEW, _wav_b64, reference, voxtral  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def voxtral_server(voxtral, thread_server):
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.server.app import build_app
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(voxtral[0]), num_kv_blocks=256, block_size=4,
                                        limit_mm_per_prompt={"audio": 1})))
    server = None
    try:
        server = thread_server(build_app(llm, "tiny-voxtral"))
        yield server.url, llm
    finally:
        if server is not None:
            server.stop()
        llm.shutdown()


def _content(data: str) -> list[dict]:
    return [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
            {"type": "text", "text": "What do you hear?"}]


def test_openai_sdk_sends_audio_to_voxtral(voxtral_server, voxtral, greedy_ref, assert_no_leaks):
    from pagedllm.media import audio_from_base64
    client = openai.OpenAI(base_url=voxtral_server[0] + "/v1", api_key="none", max_retries=0)
    data = _wav_b64(clip(1.2, 520, 4))
    reply = client.chat.completions.create(model="tiny-voxtral", messages=[{"role": "user", "content": _content(data)}],
                                           temperature=0, max_tokens=MAX_NEW, extra_body={"ignore_eos": True})
    tok = voxtral[2]
    text = tok.apply_chat_template([{"role": "user", "content": f"{AUDIO}\nWhat do you hear?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids, _ = reference(voxtral, greedy_ref, text, [audio_from_base64(data, "clip", 16000)], False)
    assert reply.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    assert reply.usage.completion_tokens == MAX_NEW
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny-voxtral", max_tokens=2,
                                       messages=[{"role": "user", "content": _content(data) * 2}])
    assert ei.value.body["param"] == "messages", ei.value.body
    assert_no_leaks(voxtral_server[1].engine)
